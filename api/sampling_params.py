"""Per-request sampling settings of step14_5: vLLM's ``SamplingParams``, with vLLM's defaults.

Everything that can be checked without the model is checked at construction, and again on
the engine's private copy at submission (``clone()`` then ``verify()``), so a parameter
object mutated after ``add_request`` changes nothing queued and nothing that passed
submission can make a step raise. ``verify`` adds the checks that need the vocabulary
(logprobs counts, token ids in ``logit_bias``, ``allowed_token_ids``, ``stop_token_ids``)
and tokenizes ``bad_words``.
"""
from __future__ import annotations

import copy
import enum
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GREEDY_TEMPERATURE = 1e-5   # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2      # 0 < temperature < this is raised to it (vLLM: avoids inf/nan)
DEFAULT_MAX_LOGPROBS = 20   # vLLM's engine argument ``max_logprobs`` default
SEED_RANGE = (-(2 ** 63), 2 ** 64)  # what a 64-bit generator seed can hold (int64 or uint64)

# vLLM fields this engine does not implement: accepted only at their default, else a clear error.
UNSUPPORTED_FIELDS = {
    "structured_outputs": "guided decoding needs a grammar backend, which this engine has not",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; use logprobs=N",
    "prompt_logprob_token_ids": "use prompt_logprobs=N",
    "prompt_logprob_start": "use prompt_logprobs=N",
    "thinking_token_budget": "reasoning budgets are not implemented",
    "repetition_detection": "repetition detection is not implemented",
    "watermarking": "watermarking is not implemented",
    "flat_logprobs": "logprobs always come as a list of dicts here",
    "trace_decode_token_ids": "trace replay is not implemented",
}


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step`` returns for an unfinished request (``LLM.generate``: final only)."""
    CUMULATIVE = 0   # everything so far, every step
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # nothing until the request finishes


@dataclass
class SamplingParams:
    """vLLM's sampling parameters; see the module docstring for when they are checked."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16         # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None         # -1 = the whole vocabulary
    prompt_logprobs: int | None = None  # -1 = the whole vocabulary
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None  # carried along; no custom logits processors here
    skip_clone: bool = False
    stream_interval: int | None = None
    skip_reading_prefix_cache: bool | None = None
    structured_outputs: Any = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    watermarking: bool | None = None
    flat_logprobs: bool = False
    trace_decode_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ public API

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_or_none(self) -> int | None:
        """top_k as a count, or None when it is off (vLLM's 0, or -1)."""
        return self.top_k if self.top_k > 0 else None

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def skips_prefix_cache_reads(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such a request computes its
        whole prompt (it still saves its blocks for others); vLLM's skip_reading_prefix_cache."""
        return bool(self.skip_reading_prefix_cache) or self.prompt_logprobs is not None

    def clone(self) -> "SamplingParams":
        """A deep copy (what the engine keeps at submission, as vLLM does)."""
        return copy.deepcopy(self)

    def verify(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
               tokenizer=None) -> None:
        """Re-check every field (the object may have been mutated since construction), then
        the vocabulary-bounded values, and tokenize ``bad_words``. Call on a ``clone()``."""
        self._validate()
        limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            _check_logprob_count(name, getattr(self, name), vocab_size, limit, max_logprobs)
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        _check_token_ids("logit_bias", list(self.logit_bias or {}), vocab_size)
        if tokenizer is None and self.stop:
            raise ValueError("stop strings need a tokenizer, but the checkpoint has none; "
                             "use stop_token_ids")
        self.bad_words_token_ids = _tokenize_bad_words(self.bad_words, tokenizer, vocab_size)

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        self._validate_counts()
        self._validate_penalties_and_filters()
        self._validate_temperature()
        self._validate_stops()
        self._validate_logprobs_and_flags()
        self._validate_token_constraints()
        self._reject_unsupported()

    def _validate_counts(self) -> None:
        self.n = _as_int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _as_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed, *SEED_RANGE,
                                hint="a 64-bit integer (-2**63 <= seed < 2**64)")
            if self.seed == -1:  # vLLM: -1 means "no seed"
                self.seed = None
        if self.stream_interval is not None:
            self.stream_interval = _as_int("stream_interval", self.stream_interval, minimum=1)

    def _validate_penalties_and_filters(self) -> None:
        self.presence_penalty = _as_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _as_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty, 0.0,
                                            math.inf, low_open=True)
        self.top_p = _as_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.min_p = _as_float("min_p", self.min_p, 0.0, 1.0)
        self.top_k = _as_int("top_k", self.top_k, minimum=-1,
                             hint="0 or -1 (off), or a count >= 1")

    def _validate_temperature(self) -> None:
        self.temperature = _as_float("temperature", self.temperature, 0.0, 2.0)
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, which "
                          f"overflows to inf/nan; raised to {MIN_TEMPERATURE} (as vLLM does)")
            self.temperature = MIN_TEMPERATURE
        if self.greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0  # they change nothing under argmax
            if self.n > 1:
                raise ValueError(f"n must be 1 for greedy sampling (temperature=0), got {self.n}")

    def _validate_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, str)
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if self.stop and not _is_bool(self.detokenize, True):
            raise ValueError("stop strings need detokenize=True")
        ids = _as_list("stop_token_ids", self.stop_token_ids, int)
        self.stop_token_ids = list(dict.fromkeys(ids))

    def _validate_logprobs_and_flags(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1  # vLLM: True means 1
            if value is not None:
                value = _as_int(name, value, minimum=-1, hint="an integer >= 0, or -1 (all)")
            setattr(self, name, value)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "skip_clone",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        if self.skip_reading_prefix_cache is not None:
            _check_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")

    def _validate_token_constraints(self) -> None:
        self.logit_bias = _as_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, int)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: no token could ever be sampled")
        self.bad_words = list(dict.fromkeys(_as_list("bad_words", self.bad_words, str)))
        if any(not w for w in self.bad_words):
            raise ValueError("bad_words cannot contain an empty string")

    def _reject_unsupported(self) -> None:
        for name, reason in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value is not False:
                raise ValueError(f"{name} is not supported by this engine: {reason}")


# ---------------------------------------------------------------------- field checks

def _is_bool(value, expected: bool) -> bool:
    return isinstance(value, (bool, np.bool_)) and bool(value) is expected


def _check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _as_int(name: str, value, minimum: int | None = None, maximum: int | None = None,
            hint: str | None = None) -> int:
    """``value`` as a Python int in [minimum, maximum); bools and floats are refused."""
    what = hint or (f"an integer >= {minimum}" if minimum is not None else "an integer")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {what}, got {value}")
    if maximum is not None and value >= maximum:
        raise ValueError(f"{name} must be {hint or f'below {maximum}'}, got {value}")
    return value


def _as_float(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] (or (low, high] with ``low_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a finite number, got nan")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}")
    return value


def _as_list(name: str, values, item_type: type) -> list:
    """None -> []; a list / tuple of ``item_type`` -> a fresh list (ints checked as ints)."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a list of {item_type.__name__}, got {values!r}")
    if item_type is int:
        return [_as_int(f"{name} entry", v) for v in values]
    bad = [v for v in values if not isinstance(v, item_type)]
    if bad:
        raise ValueError(f"{name} must contain only {item_type.__name__}, got {bad[0]!r}")
    return list(values)


def _as_logit_bias(bias) -> dict[int, float] | None:
    """{token id (int or numeric string): finite float}."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) else _as_int("logit_bias key", key)
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        out[token] = _as_float(f"logit_bias[{token}]", value, -math.inf, math.inf)
        if math.isinf(out[token]):
            raise ValueError(f"logit_bias[{token}] must be finite, got {value}")
    return out


def _check_logprob_count(name: str, value: int | None, vocab_size: int, limit: int,
                         max_logprobs: int) -> None:
    if value is None or value == 0:
        return
    wanted = vocab_size if value == -1 else value
    if wanted > vocab_size:
        raise ValueError(f"{name}={value} exceeds the vocabulary size {vocab_size}")
    if wanted > limit:
        raise ValueError(f"{name}={value} exceeds max_logprobs={max_logprobs} (an engine "
                         f"argument, as in vLLM; max_logprobs=-1 allows the whole vocabulary)")


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token id(s) {bad[:5]} outside the vocabulary "
                         f"[0, {vocab_size})")


def _tokenize_bad_words(words: list[str], tokenizer, vocab_size: int) -> list[list[int]] | None:
    """Each word as token ids, and after a space when that spelling is another token of the
    same length (so the word is banned at the start of the text and mid-text, as vLLM does)."""
    if not words:
        return None
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer, but the checkpoint has none")
    sequences: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    _check_token_ids("bad_words", [t for ids in sequences for t in ids], vocab_size)
    return sequences
