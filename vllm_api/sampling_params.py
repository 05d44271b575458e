"""vLLM's ``SamplingParams``: the core's (core/sampling_params.py) plus the fields of vLLM
features this engine does not serve, and the msgspec-struct introspection scripts use.

Those fields construct at any value and are refused when the parameters are used (``verify``,
at submission), as vLLM checks them there too, with a message that names the feature. The
core's checks run ``in_vllms_words()`` (validation.py): their errors are
``VLLMValidationError``s with vLLM's messages.
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
from core.sampling_params import as_int, check_bool, require
from vllm_api.errors import VLLMValidationError, refuse
from vllm_api.member_refusals import SAMPLING_REFUSED
from vllm_api.refusals import refuses
from vllm_api.structured import check_structured
from vllm_api.validation import in_vllms_words

__all__ = ["SamplingParams", "SamplingType", "RequestOutputKind", "RepetitionDetectionParams"]

# vLLM fields this engine does not implement: accepted only at their default, else a clear error.
UNSUPPORTED_FIELDS = {
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; use logprobs=N",
    "prompt_logprob_token_ids": "use prompt_logprobs=N",
    "prompt_logprob_start": "use prompt_logprobs=N",
    "thinking_token_budget": "reasoning budgets are not implemented",
    "repetition_detection": "repetition detection is not implemented",
    "watermarking": "watermarking is not implemented",
    "flat_logprobs": "logprobs always come as a list of dicts here",
    "trace_decode_token_ids": "trace replay is not implemented",
    "routed_experts_prompt_start": "mixture-of-experts routing records are not implemented",
}
# Unsupported fields whose "off" value is neither None nor False (vLLM's defaults).
OFF_VALUES = {"routed_experts_prompt_start": 0}
# The feature each unsupported field stands for, as its refusal names it (else its name).
UNSUPPORTED_FEATURES: dict[str, str] = {}


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
class SamplingParams(CoreSamplingParams):
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
        """The core's checks (at submission), after refusing the features this engine lacks."""
        with in_vllms_words():
            self._validate()
            self._refuse_unsupported()
            super().check_against(vocab_size, max_logprobs, tokenizer)

    def verify(self, model_config, speculative_config=None, structured_outputs_config=None,
               tokenizer=None) -> None:
        """vLLM's ``verify``: the submission checks against a ``ModelConfig`` (model_config.py)."""
        self.check_against(model_config.get_vocab_size(), model_config.max_logprobs, tokenizer)

    def _validate(self) -> None:
        with in_vllms_words():
            self._validate_fields()

    def _validate_fields(self) -> None:
        super()._validate()
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        check_bool("skip_clone", self.skip_clone)
        if self.stream_interval is not None:
            self.stream_interval = as_int("stream_interval", self.stream_interval)
            require(self.stream_interval >= 1, "stream_interval", self.stream_interval,
                     f"stream_interval must be at least 1, got {self.stream_interval}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise VLLMValidationError(f"extra_args must be a dict, got "
                                 f"{type(self.extra_args).__name__}",
                                 parameter="extra_args", value=self.extra_args)

    def _refuse_unsupported(self) -> None:
        if self.structured_outputs is not None:
            check_structured(self.structured_outputs)
        for name, reason in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value is not False and value != OFF_VALUES.get(name):
                refuse(UNSUPPORTED_FEATURES.get(name, name), f"{name}={value!r}: {reason}")


# Field names in declaration order, as a msgspec struct lists them (scripts filter kwargs by it).
SamplingParams.__struct_fields__ = tuple(f.name for f in dataclasses.fields(SamplingParams)
                                         if f.init)
