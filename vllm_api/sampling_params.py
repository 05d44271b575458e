"""vLLM's ``SamplingParams``: the core's (core/sampling_params.py) plus the fields of vLLM
features this engine does not serve, and the msgspec-struct introspection scripts use.

Those fields construct at any value and are refused when the parameters are used (at
submission, by the intake: vllm_api/intake.py; or ``verify``), as vLLM checks them there too,
with a message that names the feature. Construction runs the core's checks and this class's
``in_vllms_words()`` (validation.py): their errors are ``VLLMValidationError``s with vLLM's
messages. At submission the request path never comes here: the intake checks these fields.
``extra_args`` is carried (custom logits processors read it); ``skip_clone`` and
``stream_interval`` are carried and change nothing.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from core.sampling_params import DEFAULT_MAX_LOGPROBS, RequestOutputKind
from core.sampling_params import SamplingParams as CoreSamplingParams
from vllm_api.member_refusals import SAMPLING_REFUSED
from vllm_api.refusals import Refusing, refuses
from vllm_api.intake import (OFF_VALUES, UNSUPPORTED_FEATURES, UNSUPPORTED_FIELDS,  # noqa: F401
                             check_vllm_fields, refuse_unserved)
from vllm_api.validation import in_vllms_words

__all__ = ["SamplingParams", "SamplingType", "RequestOutputKind", "RepetitionDetectionParams"]


class SamplingType(enum.IntEnum):
    """vLLM's classification of a request's sampling (``SamplingParams.sampling_type``)."""
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class RepetitionDetectionParams:
    """vLLM's n-gram repetition detection settings: construct; a request carrying them is
    refused at submission (``repetition_detection`` in UNSUPPORTED_FIELDS)."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


@refuses("SamplingParams", SAMPLING_REFUSED)
@dataclass
class SamplingParams(CoreSamplingParams, Refusing):
    """vLLM's sampling parameters; see core/sampling_params.py for when they are checked."""

    extra_args: dict[str, Any] | None = None  # carried along; custom logits processors read it
    skip_clone: bool = False
    stream_interval: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    watermarking: bool | None = None
    flat_logprobs: bool = False
    trace_decode_token_ids: list[int] | None = None
    routed_experts_prompt_start: int = 0
    # Characters held back while streaming, so a stop string can still be cut: a field, as in
    # vLLM, set from the stop strings when there are any (the value given is kept otherwise).
    output_text_buffer_length: int = 0

    @property
    def sampling_type(self) -> SamplingType:
        """vLLM's GREEDY / RANDOM / RANDOM_SEED."""
        if self.greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The request's own stop token ids (the engine adds the model's EOS ids itself)."""
        return set(self.stop_token_ids or ())

    @property
    def num_logprobs(self) -> int | None:
        """Sample logprobs per output token, or None (vLLM's)."""
        return self.logprobs

    @property
    def eos_token_id(self) -> int | None:
        """vLLM sets this from the model at submission; here the engine keeps EOS ids itself."""
        return None


    @staticmethod
    def from_optional(
            n: int | None = 1, presence_penalty: float | None = 0.0,
            frequency_penalty: float | None = 0.0, repetition_penalty: float | None = 1.0,
            temperature: float | None = 1.0, watermarking: bool | None = None,
            top_p: float | None = 1.0, top_k: int = 0, min_p: float = 0.0,
            seed: int | None = None, stop=None, stop_token_ids=None, bad_words=None,
            thinking_token_budget: int | None = None, include_stop_str_in_output: bool = False,
            ignore_eos: bool = False, max_tokens: int | None = 16, min_tokens: int = 0,
            logprobs: int | None = None, prompt_logprobs: int | None = None,
            prompt_logprob_token_ids=None, prompt_logprob_start: int | None = None,
            detokenize: bool = True, skip_special_tokens: bool = True,
            spaces_between_special_tokens: bool = True,
            output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
            stream_interval: int | None = None, structured_outputs=None, logit_bias=None,
            allowed_token_ids=None, extra_args=None, skip_clone: bool = False,
            repetition_detection=None, logprob_token_ids=None,
            routed_experts_prompt_start: int = 0,
            trace_decode_token_ids=None) -> "SamplingParams":
        """vLLM's ``from_optional``, with its named parameters (frameworks inspect them):
        ``None`` for a field that cannot be None (``n``, ``temperature``, ...) means its
        default; where None has a meaning (``max_tokens``, ``seed``, ...) it is kept."""
        given = dict(locals())
        fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{name: value for name, value in given.items()
                                 if value is not None or "None" in str(fields[name].type)})

    def check_against(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                      tokenizer=None) -> None:
        """The submission's checks, as the intake runs them (vllm_api/intake.py), in vLLM's
        words: the vLLM fields, the refusals, then the core's."""
        with in_vllms_words():
            check_vllm_fields(self)
            refuse_unserved(self)
            super().check_against(vocab_size, max_logprobs, tokenizer)

    def verify(self, model_config, speculative_config=None, structured_outputs_config=None,
               tokenizer=None) -> None:
        """vLLM's ``verify``: the submission checks against a ``ModelConfig`` (model_config.py)."""
        self.check_against(model_config.get_vocab_size(), model_config.max_logprobs, tokenizer)

    def _validate(self) -> None:
        """At construction: the core's checks and this class's own fields, in vLLM's words."""
        with in_vllms_words():
            super()._validate()
            check_vllm_fields(self)
            if self.stop and not self.include_stop_str_in_output:
                self.output_text_buffer_length = max(len(s) for s in self.stop) - 1


# Field names in declaration order, as a msgspec struct lists them (scripts filter kwargs by it).
SamplingParams.__struct_fields__ = tuple(f.name for f in dataclasses.fields(SamplingParams)
                                         if f.init)
