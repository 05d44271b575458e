"""The engine's configuration: ``EngineConfig``, the fields ``LLM(model, **kwargs)`` sets (after
``api/engine_args.py`` has sorted vLLM's argument names). Checked once, at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from prefix_cache import HASH_STRATEGIES

LOGPROBS_MODES = ("raw_logprobs",)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None        # explicit pool size; else sized from a budget
    kv_cache_memory: int | None = None      # KV budget in bytes
    gpu_memory_utilization: float = 0.9     # fraction of free device memory (CUDA)
    cpu_kv_cache_fraction: float = 0.1      # fraction of available RAM (CPU)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None        # None: the checkpoint's; above it is an error
    num_threads: int | None = None          # CPU: most torch threads (None: as the caller set torch)
    device: str | None = None
    dtype: str | None = "auto"
    seed: int | None = 0
    enable_prefix_caching: bool = True
    hash_strategy: str = "incremental"
    fast_paths: bool = True                 # False: the plain attention and linears of model.py only
    max_logprobs: int = 20                  # as vLLM: -1 allows the whole vocabulary
    logprobs_mode: str = "raw_logprobs"
    tokenizer: str | None = None            # tokenizer directory, if not the model's
    skip_tokenizer_init: bool = False       # no tokenizer: token-id prompts, no text
    chat_template: str | None = None        # a Jinja template (or a file) for chat()
    generation_config: str = "auto"         # "auto" (the model's), "vllm" (none), or a dir
    override_generation_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.hash_strategy not in HASH_STRATEGIES:
            raise ValueError(f"hash_strategy must be one of {HASH_STRATEGIES}, got {self.hash_strategy!r}")
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is not supported: logprobs "
                             f"are always of the raw model distribution ('raw_logprobs')")
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict")
