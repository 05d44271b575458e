"""vLLM's engine arguments, sorted: what this engine implements, what is neutral here, and what
it cannot do.

``LLM(model, **kwargs)`` and ``EngineArgs(model, **kwargs)`` accept vLLM's names so a vLLM script
runs unchanged. Each name is one of:

- ours: a field of ``EngineConfig`` (``block_size``, ``max_model_len``, ``seed``, ...);
- renamed: vLLM's name for one of ours (``kv_cache_memory_bytes`` -> ``kv_cache_memory``);
- neutral: it changes nothing in a single-process pure-PyTorch engine on one device
  (``tensor_parallel_size=1``, ``revision``, ...), accepted for
  any value or only for its neutral values;
- unsupported: what this engine truly cannot do (tensor parallelism > 1, LoRA, quantized
  weights, ...): accepted at its default only, otherwise a ``ValueError`` that says why.

Any other name is a ``TypeError``, as in vLLM. ``None`` for any of them means "the default"
(vLLM's convention; lm-eval and TRL pass ``max_num_seqs=None``): a neutral or unsupported
argument given None is accepted, and ``EngineConfig`` fills its own fields given None.

``EngineArgs.add_cli_args`` gives ``--model`` a default (the shipped demo model, where vLLM
names a hub model), so ``parser.set_defaults(model=...)`` works as in vLLM's examples.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import typing
from dataclasses import dataclass

from pathlib import Path

from vllm_api.config import EngineConfig
from vllm_api.engine_arg_refusals import FEATURE_OF, check_off
from vllm_api.errors import refuse
from vllm_api.refusals import Refusing, refuses, vllm_members

ONE_DEVICE = "this engine runs in one process on one device"
DEMO_MODEL = str(Path(__file__).resolve().parent.parent / "demo_model")
LORA_OFF = "LoRA is off (enable_lora=True is refused), so LoRA sizes change nothing"


@dataclass(frozen=True)
class Neutral:
    """Accepted and ignored: ``values`` are the neutral ones (None: any value is)."""
    why: str
    values: tuple | None = None


@dataclass(frozen=True)
class Unsupported:
    """Accepted only at one of ``defaults``; any other value raises with ``why``."""
    why: str
    defaults: tuple = (None,)


RENAMED = {
    "kv_cache_memory_bytes": "kv_cache_memory",
    "num_gpu_blocks_override": "num_kv_blocks",
}

NEUTRAL = {
    "tensor_parallel_size": Neutral(ONE_DEVICE, (1,)),
    "pipeline_parallel_size": Neutral(ONE_DEVICE, (1,)),
    "data_parallel_size": Neutral(ONE_DEVICE, (1,)),
    "distributed_executor_backend": Neutral(ONE_DEVICE, (None, "mp", "uni", "external_launcher")),
    "disable_custom_all_reduce": Neutral(ONE_DEVICE),
    "compilation_config": Neutral("the only compiled code is the fast layer's C++ kernels, "
                                  "switched off by enforce_eager=True"),
    "cudagraph_capture_sizes": Neutral("the engine uses no CUDA graphs"),
    "max_cudagraph_capture_size": Neutral("the engine uses no CUDA graphs"),
    "max_seq_len_to_capture": Neutral("the engine uses no CUDA graphs"),
    "disable_log_stats": Neutral("the engine logs no statistics; LLM.stats() has them"),
    "revision": Neutral("checkpoints are local directories: no revision to choose"),
    "tokenizer_revision": Neutral("checkpoints are local directories: no revision to choose"),
    "code_revision": Neutral("checkpoints are local directories: no revision to choose"),
    "download_dir": Neutral("checkpoints are local directories: nothing is downloaded"),
    "hf_token": Neutral("checkpoints are local directories: nothing is downloaded"),
    "use_tqdm_on_load": Neutral("loading shows no progress bar"),
    "served_model_name": Neutral("there is no server"),
    "swap_space": Neutral("preempted sequences are recomputed, never swapped"),
    "enable_chunked_prefill": Neutral("prefill is always chunked to max_num_batched_tokens"),
    "async_scheduling": Neutral("steps run synchronously; results are the same"),
    "stream_interval": Neutral("LLMEngine.step returns every step's output"),
    "tokenizer_mode": Neutral("the tokenizer loads with transformers' AutoTokenizer",
                              ("auto", "hf", "slow")),
    "kv_cache_dtype": Neutral("the KV cache has the model's dtype", ("auto",)),
    "runner": Neutral("the engine generates text", ("auto", "generate")),
    "convert": Neutral("the engine generates text", ("auto", "none")),
    "model_impl": Neutral("the engine's own decoder is the only implementation",
                          ("auto", "vllm")),
    "max_loras": Neutral(LORA_OFF),
    "max_lora_rank": Neutral(LORA_OFF),
    "max_cpu_loras": Neutral(LORA_OFF),
    "lora_dtype": Neutral(LORA_OFF),
    "fully_sharded_loras": Neutral(LORA_OFF),
    "structured_outputs_config": Neutral("structured outputs always use xgrammar (vLLM's "
                                         "default backend)"),
    "guided_decoding_backend": Neutral("structured outputs always use xgrammar (vLLM's "
                                       "default backend)", (None, "auto", "xgrammar")),
    "reasoning_parser": Neutral("there is no server to parse reasoning for"),
    "enable_log_requests": Neutral("the engine logs no requests"),
    "disable_log_requests": Neutral("the engine logs no requests"),
    "attention_backend": Neutral("the engine's own paged attention is the only backend"),
    "attention_config": Neutral("the engine's own paged attention is the only backend"),
    "disable_cascade_attn": Neutral("the engine has no cascade attention"),
    "max_num_partial_prefills": Neutral("prefill is always chunked to max_num_batched_tokens"),
    "long_prefill_token_threshold": Neutral("prefill is always chunked to "
                                            "max_num_batched_tokens"),
    "tokenizer_pool_size": Neutral("the tokenizer runs in this process"),
    "seed_everything": Neutral("the engine seeds its own sampler from seed"),
    "disable_sliding_window": Neutral("sliding windows follow the checkpoint", (False,)),
    "allowed_local_media_path": Neutral("multimodal inputs are not supported", ("",)),
    "shutdown_timeout": Neutral("there is no engine process to shut down"),
    "max_parallel_loading_workers": Neutral("weights load in this process"),
}

UNSUPPORTED = {
    "quantization_config": Unsupported("pre-quantized safetensors checkpoints are not read: "
                                       "weights load as float32 / bfloat16 / float16 from "
                                       "safetensors (quantization='int8' quantizes them at "
                                       "load); a GGUF file's Q8_0 / Q4_0 tensors load as they "
                                       "are (LLM('model.gguf'))"),
    "enable_lora": Unsupported("LoRA adapters are not supported", (None, False)),
    "enable_prompt_embeds": Unsupported("prompt embeddings are not supported", (None, False)),
    "speculative_config": Unsupported("speculative decoding is not supported"),
    "spec_method": Unsupported("speculative decoding is not supported"),
    "spec_model": Unsupported("speculative decoding is not supported"),
    "spec_tokens": Unsupported("speculative decoding is not supported"),
    "cpu_offload_gb": Unsupported("weight offloading is not supported", (None, 0)),
    "enable_expert_parallel": Unsupported("mixture-of-experts models are not supported",
                                          (None, False)),
    "kv_transfer_config": Unsupported("KV transfer between engines is not supported"),
    "limit_mm_per_prompt": Unsupported("multimodal inputs are not supported"),
    "mm_processor_kwargs": Unsupported("multimodal inputs are not supported"),
    "pooler_config": Unsupported("pooling models are not supported"),
    "enable_sleep_mode": Unsupported("sleep mode is not supported", (None, False)),
    "worker_cls": Unsupported("custom workers are not supported", (None, "auto")),
}


BUILD_IT = ("the engine builds its own config", "build the engine from these arguments "
             "(LLM(**asdict(args)), LLMEngine.from_engine_args(args)); its model_config is "
             "vLLM's ModelConfig")
ENGINE_ARGS_REFUSED = {name: BUILD_IT for name in (
    "create_model_config", "validate_tensorizer_args", "create_load_config",
    "create_speculative_config", "create_diffusion_config", "create_watermark_config",
    "create_structured_outputs_config", "create_observability_config", "create_logging_config",
    "create_engine_config", "get_batch_defaults")}


# vLLM's LLMEngine / AsyncLLM constructor parameters that are not engine arguments: vLLM builds
# them from its internal config and executor; here they take the model and engine arguments.
CONSTRUCTOR_INTERNALS = ("vllm_config", "executor_class", "log_stats", "usage_context",
                         "stat_loggers", "mm_registry", "multiprocess_mode", "use_cached_outputs",
                         "log_requests", "start_engine_loop", "client_addresses", "client_count",
                         "client_index", "profiler")


def refuse_constructor_internals(kwargs: dict) -> None:
    """Refuse, by name, a vLLM constructor parameter given a value (None is its absence)."""
    for name in CONSTRUCTOR_INTERNALS:
        if kwargs.get(name) is not None:
            refuse(f"building the engine from vLLM's internals ({name}=)",
                   "pass the model and engine arguments (EngineArgs' fields), as LLM(...) takes "
                   "them; the engine has no executor, stat loggers or front-end clients")
        kwargs.pop(name, None)


def translate_engine_args(kwargs: dict, own_fields) -> dict:
    """The ``EngineConfig`` keyword arguments for vLLM-style ``kwargs``: ours and renamed ones
    kept, neutral ones dropped, anything else rejected (see the module docstring)."""
    config, unknown = {}, []
    for name, value in kwargs.items():
        if name in own_fields:
            config[name] = value
        elif name in RENAMED:
            if value is not None:  # None: the default, which must not undo the new name's value
                config[RENAMED[name]] = value
        elif name in NEUTRAL:
            _check_neutral(name, value, NEUTRAL[name])
        elif name in UNSUPPORTED:
            _check_unsupported(name, value, UNSUPPORTED[name])
        elif name in FEATURE_OF:
            check_off(name, value)
        else:
            unknown.append(name)
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))} (neither "
                        f"this engine's nor a vLLM argument it knows; see engine_args.py)")
    return config


def _check_neutral(name: str, value, rule: Neutral) -> None:
    if value is not None and rule.values is not None and value not in rule.values:
        allowed = ", ".join(repr(v) for v in rule.values)
        raise ValueError(f"{name}={value!r} is not supported: {rule.why} (accepted: {allowed})")


def _check_unsupported(name: str, value, rule: Unsupported) -> None:
    if value in rule.defaults or value in ({}, []):
        return
    raise ValueError(f"{name}={value!r} is not supported: {rule.why}")


class EngineArgsMethods:
    """What vLLM's ``EngineArgs`` does besides holding the arguments: the command line."""

    @property
    def kwargs(self) -> dict:
        """The arguments given a value other than their default (what builds the engine)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "model" and getattr(self, f.name) != _default_of(f)}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--model", default=DEMO_MODEL,
                            help="local Hugging Face checkpoint dir (default: the demo model)")
        for name, spec in EngineConfig.__dataclass_fields__.items():
            if spec.default is dataclasses.MISSING:
                continue  # override_generation_config: a dict, Python only
            flag, kind = _flag(name), _cli_type(str(spec.type))
            if spec.type == "object":  # a config or a dict: JSON on the command line, as vLLM
                parser.add_argument(flag, type=json.loads, default=spec.default)
            elif kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default)
            else:
                parser.add_argument(flag, type=kind, default=spec.default)
        for name in (*RENAMED, *NEUTRAL, *UNSUPPORTED):
            parser.add_argument(_flag(name), type=_cli_value, nargs="?", const=True,
                                default=None, help=argparse.SUPPRESS)  # None: not given
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        fields = EngineConfig.__dataclass_fields__
        known = {*RENAMED, *NEUTRAL, *UNSUPPORTED}
        given = {k: v for k, v in vars(args).items()
                 if (k in fields and v != fields[k].default) or (k in known and v is not None)}
        return cls(args.model, **given)


def _default_of(spec: dataclasses.Field):
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def _engine_args_fields() -> list[tuple]:
    """``model``, then this engine's own fields at their defaults, then every other name a
    vLLM script may pass (vLLM 0.32's fields, the tables above) at None, "the default"."""
    own = [(f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
           for f in dataclasses.fields(EngineConfig)]
    vllm_fields = [name for name, member in vllm_members()["EngineArgs"]["members"].items()
                   if member["kind"] == "field"]
    taken = {"model"} | {f[0] for f in own}
    rest = [n for n in dict.fromkeys([*vllm_fields, *RENAMED, *NEUTRAL, *UNSUPPORTED, *FEATURE_OF])
            if n not in taken]
    return [("model", str, dataclasses.field(default=DEMO_MODEL)), *own,
            *[(name, typing.Any, dataclasses.field(default=None)) for name in rest]]


ENGINE_ARGS_DOC = """vLLM's ``EngineArgs``, a dataclass as vLLM's is (``dataclasses.asdict(args)`` and
``LLM(**asdict(args))`` work): the model and every engine argument, checked when the engine is
built (``LLMEngine.from_engine_args``). ``add_cli_args`` / ``from_cli_args`` cover the
arguments this engine implements and the vLLM names it accepts (see the tables above)."""

@functools.cache
def _engine_args_classes() -> tuple[type, type]:
    """``EngineArgs`` and ``AsyncEngineArgs``, built from vLLM's field listing the first time a
    script asks for either (the engine itself never needs them)."""
    engine_args = refuses("EngineArgs", ENGINE_ARGS_REFUSED)(dataclasses.make_dataclass(
        "EngineArgs", _engine_args_fields(), bases=(EngineArgsMethods, Refusing),
        namespace={"__doc__": ENGINE_ARGS_DOC, "__module__": __name__}))
    async_engine_args = type("AsyncEngineArgs", (engine_args,), {
        "__doc__": "vLLM's ``AsyncEngineArgs``: the same arguments, for "
                   "``AsyncLLM.from_engine_args``.", "__module__": __name__})
    return engine_args, async_engine_args


def __getattr__(name: str):
    if name in ("EngineArgs", "AsyncEngineArgs"):
        return _engine_args_classes()[name == "AsyncEngineArgs"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _cli_value(text: str):
    """A command-line value of a vLLM argument: an int, float, bool or None if it reads as
    one, else the string (so ``--tensor-parallel-size 1`` is the neutral 1)."""
    literals = {"true": True, "false": False, "none": None}
    if text.lower() in literals:
        return literals[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _cli_type(annotation: str) -> type:
    """The command-line type of an ``EngineConfig`` field from its annotation ("int | None")."""
    for kind in (bool, int, float):
        if annotation.split(" | ")[0] == kind.__name__:
            return kind
    return str
