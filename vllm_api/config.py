"""The engine's configuration: ``EngineConfig``, the fields ``LLM(model, **kwargs)`` sets (after
``api/engine_args.py`` has sorted vLLM's argument names). Checked once, at construction.

As in vLLM, ``None`` for a field means that field's default (lm-eval and TRL pass
``max_num_seqs=None``), except where None is itself a setting: the fields whose default is
None, and ``seed`` (None: unseeded). Optional inputs that name files -- ``tokenizer``,
``chat_template`` given as a path, ``generation_config`` given as a directory -- are opened
here, so a wrong path fails at start-up naming it instead of being silently ignored.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import get_args

from vllm_api.checkpoint_files import check_generation_config_dir, check_tokenizer_dir, read_template
from model import QUANTIZATIONS
from core.kv_disk import WRITE_MODES
from prefix_cache import HASH_STRATEGIES
from vllm_api.block_hash import HASH_ALGOS
from vllm_api.type_aliases import LogprobsMode

# What logprobs are of (vLLM's logprobs_mode): the raw model output, or what sampling drew
# from after penalties, bias, temperature, min_p, top-k and top-p; as logprobs or logits.
LOGPROBS_MODES = get_args(LogprobsMode)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
GGUF = "gguf"  # vLLM's quantization name for a GGUF file's own types (core/gguf.py)
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's SchedulerPolicy
NONE_IS_A_SETTING = {"seed"}  # fields whose None means something other than the default


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
    enforce_eager: bool = False             # True: no compiled kernels (fast/kernels.py), PyTorch ops only
    max_logprobs: int = 20                  # as vLLM: -1 allows the whole vocabulary
    logprobs_mode: str = "raw_logprobs"
    tokenizer: str | None = None            # tokenizer directory, if not the model's
    skip_tokenizer_init: bool = False       # no tokenizer: token-id prompts, no text
    chat_template: str | None = None        # a Jinja template (or a file) for chat()
    generation_config: str = "auto"         # "auto" (the model's), "vllm" (none), or a dir
    override_generation_config: dict = field(default_factory=dict)
    profiler_config: object = None          # ProfilerConfig / dict: where start_profile writes
    prefix_caching_hash_algo: str | None = None  # vLLM's block hash (block_hash.py); None: xxh3_64
    kv_events_config: object = None         # KVEventsConfig / dict: publish cache events (kv_events.py)
    hf_overrides: object = None             # dict or callable applied to the HF config (loading.py)
    load_format: str = "auto"               # "auto" / "safetensors": the weights; "dummy": random
    trust_remote_code: bool = False         # to every transformers call: False runs no checkpoint code
    quantization: str | None = None         # "int8": 8-bit weights quantized at load (model.py)
    scheduling_policy: str = "fcfs"         # "priority": generate(..., priority=[...]) orders admission
    logits_processors: object = None        # vLLM v1 LogitsProcessor classes (or their names)
    kv_disk_dir: str | None = None          # the prefix cache's disk tier (core/kv_disk.py); None: off
    kv_disk_size: float = 4.0               # its budget in GiB (as vLLM's kv_offloading_size)
    kv_disk_write: str = "evict"            # "evict": blocks leaving the pool; "save": every saved block

    def __post_init__(self) -> None:
        self._fill_defaults_for_none()
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
        self._check_disk_tier()
        self._check_vllm_fields()

    def _check_disk_tier(self) -> None:
        if not isinstance(self.kv_disk_size, (int, float)) or self.kv_disk_size <= 0:
            raise ValueError(f"kv_disk_size must be > 0 GiB, got {self.kv_disk_size!r}")
        if self.kv_disk_write not in WRITE_MODES:
            raise ValueError(f"kv_disk_write must be one of {WRITE_MODES}, got {self.kv_disk_write!r}")

    def _check_vllm_fields(self) -> None:
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got "
                             f"{self.logprobs_mode!r}")
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict")
        if self.prefix_caching_hash_algo is not None and self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not supported: weights load "
                             f"from *.safetensors or a .gguf file, or are random with 'dummy' (accepted: "
                             f"{', '.join(LOAD_FORMATS)})")
        if self.quantization not in (None, GGUF) and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"Unknown quantization method: {self.quantization}. Must be one of "
                             f"{list(QUANTIZATIONS)} (weights quantized at load from a float "
                             f"checkpoint), or 'gguf' for a GGUF file's own tensor types.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        if self.hf_overrides is not None and not (isinstance(self.hf_overrides, dict)
                                                  or callable(self.hf_overrides)):
            raise ValueError(f"hf_overrides must be a dict or a callable taking and returning "
                             f"the Hugging Face config, got {type(self.hf_overrides).__name__}")
        self._check_side_files()

    def _fill_defaults_for_none(self) -> None:
        """None means "the default" (vLLM's convention), where None is not itself a setting."""
        for spec in fields(self):
            if getattr(self, spec.name) is not None or spec.name in NONE_IS_A_SETTING:
                continue
            if spec.default_factory is not MISSING:
                setattr(self, spec.name, spec.default_factory())
            elif spec.default is not None:
                setattr(self, spec.name, spec.default)

    def _check_side_files(self) -> None:
        """Open the optional inputs that name files now, so a wrong path fails at start-up."""
        if self.tokenizer is not None and not self.skip_tokenizer_init:
            check_tokenizer_dir(self.tokenizer)
        if self.chat_template is not None:
            read_template(self.chat_template)
        if self.generation_config not in ("auto", "vllm"):
            check_generation_config_dir(self.generation_config)
