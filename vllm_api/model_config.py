"""vLLM's ``ModelConfig`` of the loaded model: ``llm.llm_engine.model_config`` (and
``LLM.model_config``), what benchmarks and frameworks read (``max_model_len``, ``dtype``,
``hf_config``, ``get_vocab_size()``, ...).

Every field and property of vLLM 0.32's ``ModelConfig`` (vllm_members.json) reads here:
the engine's own value where it has one; for a feature this engine lacks (multimodal inputs,
quantization, sleep mode, Mamba, MLA, ...) vLLM's default, which is that feature off, so
the answer is true of this engine. The few methods with no counterpart are refused naming
the feature. The model's own config (model.py's ``ModelConfig``: ``vocab_size``,
``num_layers``, ``head_dim``...) stays readable through it, as before.
"""
from __future__ import annotations

import functools
import hashlib

from vllm_api.errors import UnsupportedAttributeError
from vllm_api.refusals import Refusing, refuses, vllm_members

# vLLM's properties and fields, as they read for a decoder-only, text-only, unquantized model
FEATURE_OFF = {
    "attn_type": "decoder", "has_inner_state": False, "has_noops": False,
    "is_attention_free": False, "is_chunked_prefill_supported": True,
    "is_deepseek_mla": False, "is_diffusion": False, "is_encoder_decoder": False,
    "is_hybrid": False, "is_matryoshka": False, "is_mm_prefix_lm": False, "is_moe": False,
    "is_multimodal_model": False, "is_multimodal_raw_input_only_model": False,
    "is_pp_supported": False, "is_prefix_caching_supported": True, "is_quantized": False,
    "matryoshka_dimensions": None, "mrope_num_dims": None, "requires_raw_input_tokens": False,
    "rswa_window": None, "supports_mamba_prefix_caching": False,
    "supports_multimodal_inputs": False, "supports_replayssm": False, "use_mla": False,
    "uses_alibi": False, "uses_mrope": False, "is_submodel_config": False,
    "word_embeddings_untied_by_checkpoint": False, "model_class_overrides": {},
    "sleep_preserve_parameter_names": [], "runner": "generate", "convert": "none",
    "trust_remote_code": False, "model_impl": "auto",
}
# Engine-argument fields the engine keeps in its EngineConfig under the same name
FROM_ENGINE_CONFIG = ("seed", "enforce_eager", "max_logprobs", "logprobs_mode",
                      "skip_tokenizer_init", "generation_config", "override_generation_config",
                      "hf_overrides")
INTERNAL = ("vLLM's config validation", "the engine checks its arguments once, at start-up")
REFUSED = {
    "registry": ("ModelRegistry", "built-in architectures only"),
    "get_model_arch_config": ("vLLM's model architecture config", "read hf_config"),
    "get_multimodal_config": ("multimodal inputs", "text-only models"),
    "get_pooling_task": ("pooling", "the engine runs generative models only"),
    "score_type": ("pooling", "the engine runs generative models only"),
    "use_sep_token": ("pooling", "the engine runs generative models only"),
    "maybe_pull_model_tokenizer_for_runai": ("Run:ai model streaming", "local checkpoints only"),
    "maybe_untie_word_embeddings": INTERNAL, "validate_model_config_after": INTERNAL,
    "validate_quantization_before": INTERNAL, "verify_dual_chunk_attention_config": INTERNAL,
    "verify_with_parallel_config": INTERNAL,
}


@refuses("ModelConfig", REFUSED)
class ModelConfig(Refusing):
    """vLLM's view of ``engine``'s model (an ``LLMEngine``)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in REFUSED:  # refused members are made when asked for (refusals.py)
            return Refusing.__getattr__(self, name)
        if name in FEATURE_OFF:
            return FEATURE_OFF[name]
        if name in FROM_ENGINE_CONFIG:
            return getattr(self._engine.config, name)
        member = vllm_members()["ModelConfig"]["members"].get(name)
        if member is not None and member["kind"] == "field":
            return member["default"]  # a feature this engine lacks: off, as in vLLM's default
        return getattr(self._engine.model.config, name)  # the model's own config

    # ------------------------------------------------------------------ the engine's values

    @property
    def model(self) -> str:
        return str(self._engine.model_path)

    served_model_name = model

    @property
    def tokenizer(self) -> str:
        return str(self._engine.config.tokenizer or self._engine.model_path)

    @property
    def dtype(self):
        return self._engine.dtype

    head_dtype = dtype

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @functools.cached_property
    def hf_config(self):
        """The checkpoint's Hugging Face config, with ``hf_overrides`` applied; for a GGUF file
        (no config.json), the config its metadata built, as transformers' class of it."""
        from vllm_api.loading import hf_config_of, is_gguf, overridden_config
        if is_gguf(self._engine.model_path):
            return hf_config_of(self._engine.model.config)
        return overridden_config(self._engine.model_path, self._engine.config.hf_overrides)

    @property
    def hf_text_config(self):
        return self.hf_config

    @property
    def architecture(self) -> str:
        return self._engine.model.config.architecture

    @property
    def architectures(self) -> list[str]:
        return [self.architecture]

    @property
    def embedding_size(self) -> int:
        return self._engine.model.config.hidden_size

    # ------------------------------------------------------------------ vLLM's getters

    def get_vocab_size(self) -> int:
        return self._engine.model.config.vocab_size

    def get_hidden_size(self) -> int:
        return self._engine.model.config.hidden_size

    get_inputs_embeds_size = get_hidden_size

    def get_head_size(self) -> int:
        return self._engine.model.config.head_dim

    def get_total_num_kv_heads(self) -> int:
        return self._engine.model.config.num_kv_heads

    def get_num_kv_heads(self, parallel_config=None, arch_config=None) -> int:
        return self.get_total_num_kv_heads()  # one device: no tensor-parallel split

    def get_num_attention_heads(self, parallel_config=None, arch_config=None) -> int:
        return self._engine.model.config.num_heads

    def get_total_num_hidden_layers(self) -> int:
        return self._engine.model.config.num_layers

    def get_num_layers(self, parallel_config=None) -> int:
        return self.get_total_num_hidden_layers()

    def get_layers_start_end_indices(self, parallel_config=None) -> tuple[int, int]:
        return 0, self.get_total_num_hidden_layers()

    def get_num_layers_by_block_type(self, parallel_config=None, block_type="attention") -> int:
        return self.get_total_num_hidden_layers() if block_type == "attention" else 0

    def get_sliding_window(self) -> int | None:
        windows = [w for w in self._engine.model.config.layer_windows if w is not None]
        return windows[0] if windows else None

    def get_num_experts(self) -> int:
        return 0

    def get_num_experts_per_tok(self) -> int:
        return 0

    def get_mamba_chunk_size(self) -> None:
        return None

    def get_diff_sampling_param(self) -> dict:
        """The checkpoint's sampling defaults (generation_config.json), as vLLM reads them."""
        params = self._engine.get_default_sampling_params()
        return {k: getattr(params, k) for k in ("repetition_penalty", "temperature", "top_k",
                                                 "top_p", "min_p", "max_tokens")
                if k in self._engine.generation_config
                or (k == "max_tokens" and "max_new_tokens" in self._engine.generation_config)}

    def try_get_generation_config(self) -> dict:
        return dict(self._engine.generation_config)

    def get_and_verify_max_len(self, max_model_len: int) -> int:
        from vllm_api.kv_sizing import resolve_max_model_len
        return resolve_max_model_len(max_model_len,
                                     self._engine.model.config.max_position_embeddings)

    def using_transformers_backend(self) -> bool:
        return False

    def is_nvfp4_quantized(self) -> bool:
        return False

    def compute_hash(self) -> str:
        """What identifies the model's computation: checkpoint, dtype, max_model_len."""
        key = f"{self.model}|{self.dtype}|{self.max_model_len}|{self.architecture}"
        return hashlib.sha256(key.encode()).hexdigest()
