"""vLLM's ``BeamSearchParams``: constructs as vLLM's; ``LLM.beam_search`` refuses it (this
engine samples one continuation per sequence and keeps no beams)."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_api.errors import VLLMValidationError

BEAM_SEARCH_REASON = ("the engine samples one continuation per sequence and keeps no beams; "
                      "use SamplingParams(n=..., temperature=...) for several candidates")


@dataclass
class BeamSearchParams:
    """Beam width, length and the options vLLM's beam search takes."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise VLLMValidationError(f"{name} must be at least 1, got {value!r}.",
                                          parameter=name, value=value)
