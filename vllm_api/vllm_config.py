"""The ``vllm.config`` classes offline scripts import to build engine arguments.

Each holds the options it was given and means what the engine argument it is passed as
means (engine_args.py): ``CompilationConfig`` / ``CompilationMode`` / ``CUDAGraphMode`` are
neutral (the engine is always eager), ``StructuredOutputsConfig`` is neutral (structured
outputs always use xgrammar), ``SpeculativeConfig``, ``KVTransferConfig`` and
``PoolerConfig`` are refused at start-up with the reason, ``ProfilerConfig`` sets where
``LLM.start_profile`` writes its trace. ``VllmConfig`` constructs; building an engine from
it (``from_vllm_config``) is refused: pass engine arguments.
"""
from __future__ import annotations

import enum


class _Options:
    """A config object: keyword options kept as attributes (vLLM's field names)."""

    def __init__(self, **options) -> None:
        self.__dict__.update(options)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def get(self, name: str, default=None):
        """Dict-style access, so code treating a config as a dict keeps working."""
        return self.__dict__.get(name, default)


class CompilationMode(enum.IntEnum):
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4


class CompilationConfig(_Options):
    """Neutral here: the engine is always eager."""


class StructuredOutputsConfig(_Options):
    """Neutral here: structured outputs always use xgrammar, vLLM's default backend."""


class SpeculativeConfig(_Options):
    """Refused at start-up: no speculative decoding."""


class KVTransferConfig(_Options):
    """Refused at start-up: no KV transfer between engines."""


class PoolerConfig(_Options):
    """Refused at start-up: generative models only."""


class VllmConfig(_Options):
    """vLLM's whole-engine config: constructs; ``from_vllm_config`` refuses it (engine
    arguments build this engine). The engine builds one for custom logits processors, with
    the sections they read (``model_config``, ``scheduler_config``, ``cache_config``,
    ``device_config``)."""

    @staticmethod
    def section(**options) -> _Options:
        """One section of the config (``scheduler_config``, ...), its fields as attributes."""
        return _Options(**options)


class ProfilerConfig(_Options):
    """``profiler="torch"`` and ``torch_profiler_dir``: where ``LLM.start_profile`` writes."""

    def __init__(self, profiler: str | None = "torch", torch_profiler_dir: str | None = None,
                 **options) -> None:
        super().__init__(profiler=profiler, torch_profiler_dir=torch_profiler_dir, **options)
