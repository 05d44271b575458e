"""vLLM's type aliases that scripts import for annotations and checks: the engine-argument
literals of ``vllm.config.model`` (``LogprobsMode`` and its kin) and the logprob shapes of
``vllm.logprobs``. Each is the set of values this engine accepts for that argument. And
``vllm.utils.random_uuid``, which async clients import for request ids; ``ExternalBlockHash``,
the type of a block hash in KV cache events (an int here; bytes under vLLM's sha256)."""
from __future__ import annotations

import uuid
from typing import Any, Callable, Literal, Union

from core.outputs import Logprob

LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"]
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
TokenizerMode = Literal["auto", "hf", "slow"]
RunnerOption = Literal["auto", "generate"]
ConvertOption = Literal["auto", "none"]
HfOverrides = Union[dict[str, Any], Callable[[Any], Any]]

LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]
PromptLogprobs = list[Union[LogprobsOnePosition, None]]
ExternalBlockHash = Union[bytes, int]


def random_uuid() -> str:
    """A fresh request id (32 hex digits), as vLLM's."""
    return uuid.uuid4().hex
