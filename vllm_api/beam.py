"""vLLM's beam search (``LLM.beam_search(prompts, BeamSearchParams(...))``), built on generation
as vLLM builds it: each step runs every live beam as a one-token request asking for its
``2 * beam_width`` most likely next tokens, extends each beam by each of them, and keeps the
``beam_width`` best per prompt (score: cumulative logprob / length ** length_penalty, EOS not
counted). A beam that emits EOS is set aside as complete (unless ``ignore_eos``).

Every beam of a step is a new request whose prompt is its whole token list, so the beams of
one prompt share all their full blocks through the prefix cache: each step recomputes at most
the last partial block and the new token, not the beam's history (``llm.stats()``'s
``prefix_cache_hits`` counts the tokens served so).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.sampling_params import MAX_N
from vllm_api.errors import VLLMValidationError, refuse

BEAM_LOGPROBS_FACTOR = 2  # candidates per beam and step, as Hugging Face and vLLM take


@dataclass
class BeamSearchParams:
    """Beam width, length and the options vLLM's beam search takes."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: object = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise VLLMValidationError(f"{name} must be an int, but is of type {type(value)}",
                                          parameter=name, value=value)
            if value < 1:
                raise VLLMValidationError(f"{name} must be at least 1, got {value}.",
                                          parameter=name, value=value)
        if self.beam_width > MAX_N:  # each beam is a sequence: the bound on n
            raise VLLMValidationError(f"beam_width must be at most {MAX_N}, got {self.beam_width}.",
                                      parameter="beam_width", value=self.beam_width)


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's included), one logprob dict per generated token."""

    orig_prompt: dict
    tokens: list[int]
    logprobs: list[dict] = field(default_factory=list)
    lora_request: object = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_ids: set[int], length_penalty: float) -> float:
    """Cumulative logprob over length ** length_penalty; a final EOS does not count."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_ids)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


@dataclass
class BeamInstance:
    """One prompt's live beams and the complete ones."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def check_supported(params: BeamSearchParams) -> None:
    if params.structured_outputs is not None:
        refuse("structured outputs with beam search", "LLM.beam_search extends each beam by "
               "one generate() call a token, so a grammar would start over at every token; "
               "use generate() with the constraint")
    if params.watermarking:
        refuse("watermarking", "not implemented")
