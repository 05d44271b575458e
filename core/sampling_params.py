"""A request's sampling settings in step14_5: what the sampler and the output processor read.

Every field is checked at construction, and again on the engine's own copy at submission
(``clone()`` then ``verify()``): a parameter object mutated after it was queued changes
nothing queued, and nothing that passed submission can make a step raise. ``verify`` adds the
checks that need the vocabulary (logprobs counts, token ids in ``logit_bias``,
``allowed_token_ids``, ``stop_token_ids``) and tokenizes ``bad_words``.

The names and defaults are vLLM's (the vLLM layer's ``SamplingParams`` adds the fields of
features this engine does not serve). The error messages are the core's own: errors are
``ParameterError`` (core/errors.py), a ``ValueError`` carrying the parameter, the value, the
rule it broke and the bound; ``LogprobsLimitError`` and ``OutOfVocabularyError`` for the
vocabulary-bounded checks. The vLLM layer rewords them in vLLM's texts
(vllm_api/validation.py).
"""
from __future__ import annotations

import copy
import enum
import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from core.errors import LogprobsLimitError, OutOfVocabularyError, ParameterError

GREEDY_TEMPERATURE = 1e-5   # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2      # 0 < temperature < this is raised to it (vLLM: avoids inf/nan)
DEFAULT_MAX_LOGPROBS = 20   # vLLM's engine argument ``max_logprobs`` default
# Bounds on what one request may fan out to, checked before anything is built from it: n (the
# sequences it runs; vLLM's own bound), the entries of each list it carries (token ids, stop
# strings, bad words: each costs work at every step) and a stop string's length.
MAX_N = 16384
MAX_LIST_ENTRIES = 1 << 20
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 4096
SEED_RANGE = (-(2 ** 63), 2 ** 64)  # what a 64-bit generator seed can hold (int64 or uint64)


class RequestOutputKind(enum.Enum):
    """What a request's caller gets before it finishes (``LLM.generate``: final only)."""
    CUMULATIVE = 0   # everything so far, every step
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # nothing until the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop; see the module docstring."""

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
    skip_reading_prefix_cache: bool | None = None
    # A constraint on the output (vLLM's StructuredOutputsParams: json, regex, choice, grammar
    # or json_object), compiled at submission (core/grammar.py).
    structured_outputs: object = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

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
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such a request computes its
        whole prompt (it still saves its blocks for others); vLLM's skip_reading_prefix_cache."""
        return not self.skip_reading_prefix_cache and self.prompt_logprobs is None

    def clone(self) -> "SamplingParams":
        """A deep copy (what the engine keeps at submission, as vLLM does): the fields deep-copied
        into a new object of the same class, which is what ``copy.deepcopy`` does, without its
        probes for ``__deepcopy__`` and ``__setstate__`` (a subclass may answer missing names)."""
        own = object.__new__(type(self))
        own.__dict__.update(copy.deepcopy(self.__dict__))
        return own

    def check_against(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                      tokenizer=None) -> None:
        """Re-check every field (the object may have been mutated since construction), then
        the vocabulary-bounded values; and tokenize ``bad_words``. Call on a ``clone()``. The
        core's own rules: a subclass's fields (the vLLM layer's) are checked at its own intake."""
        SamplingParams._validate(self)
        limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            _check_logprob_count(name, getattr(self, name), vocab_size, limit, max_logprobs)
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParameterError("allowed_token_ids is empty: no token could ever be sampled",
                                 parameter="allowed_token_ids", value=self.allowed_token_ids,
                                 rule="empty")
        _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        _check_token_ids("logit_bias", list(self.logit_bias or {}), vocab_size)
        if tokenizer is None and self.stop:
            raise ParameterError("stop strings need a tokenizer, but the engine has none "
                                 "(no tokenizer in the checkpoint, or "
                                 "skip_tokenizer_init=True); use stop_token_ids",
                                 parameter="stop", value=self.stop)
        self.bad_words_token_ids = _tokenize_bad_words(self.bad_words, tokenizer, vocab_size)

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        self._validate_counts()
        self._validate_penalties_and_filters()
        self._validate_temperature()
        self._validate_stops()
        self._validate_logprobs_and_flags()
        self._validate_token_constraints()

    def _validate_counts(self) -> None:
        self.n = as_int("n", self.n)
        require(self.n >= 1, "n", self.n, f"n must be >= 1 (one sequence at least), "
                                          f"got {self.n}", rule="minimum", bound=1)
        require(self.n <= MAX_N, "n", self.n, f"n must be at most {MAX_N}, got {self.n}.")
        if self.max_tokens is not None:
            self.max_tokens = as_int("max_tokens", self.max_tokens)
            require(self.max_tokens >= 1, "max_tokens", self.max_tokens,
                    f"max_tokens must be >= 1 (or None: up to max_model_len), got "
                    f"{self.max_tokens}", rule="minimum", bound=1)
        self.min_tokens = as_int("min_tokens", self.min_tokens)
        require(self.min_tokens >= 0, "min_tokens", self.min_tokens,
                f"min_tokens must be >= 0, got {self.min_tokens}", rule="minimum", bound=0)
        if self.max_tokens is not None:
            require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                    f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
                    rule="maximum", bound=self.max_tokens)
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, hint="a 64-bit integer")
            require(SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", self.seed,
                     f"seed must be a 64-bit integer (-2**63 <= seed < 2**64), got {self.seed}")
            if self.seed == -1:  # vLLM: -1 means "no seed"
                self.seed = None

    def _validate_penalties_and_filters(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            require(-2.0 <= value <= 2.0, name, value, f"{name} must lie in [-2, 2], got {value}",
                    rule="range", bound=(-2.0, 2.0))
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        require(math.isfinite(self.repetition_penalty), "repetition_penalty",
                 self.repetition_penalty, f"repetition_penalty must be a finite number, got "
                                          f"{self.repetition_penalty}.")
        require(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
                f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}",
                rule="positive", bound=0.0)
        self.top_p = _as_float("top_p", self.top_p)
        require(0.0 < self.top_p <= 1.0, "top_p", self.top_p,
                f"top_p must lie in (0, 1] (1: off), got {self.top_p}", rule="range",
                bound=(0.0, 1.0))
        self.min_p = _as_float("min_p", self.min_p)
        require(0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
                f"min_p must lie in [0, 1] (0: off), got {self.min_p}", rule="range",
                bound=(0.0, 1.0))
        self.top_k = as_int("top_k", self.top_k)
        require(self.top_k >= -1, "top_k", self.top_k,
                f"top_k must be >= 1, or 0 / -1 (off), got {self.top_k}", rule="minimum",
                bound=-1)

    def _validate_temperature(self) -> None:
        value = self.temperature = _as_float("temperature", self.temperature)
        require(math.isfinite(value), "temperature", value,
                 f"temperature must be a finite number, got {value}.")
        require(value >= 0.0, "temperature", value,
                f"temperature must be >= 0 (0: greedy), got {value}", rule="minimum", bound=0.0)
        require(value <= 2.0, "temperature", value, f"temperature must be in [0, 2], got {value}.")
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, which "
                          f"overflows to inf/nan; raised to {MIN_TEMPERATURE} (as vLLM does)")
            self.temperature = MIN_TEMPERATURE
        if self.greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0  # they change nothing under argmax
            require(self.n == 1, "n", self.n,
                    f"greedy sampling (temperature 0) gives one sequence, so n must be 1, "
                    f"got {self.n}", rule="greedy", bound=1)

    def _validate_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, str)
        require(all(self.stop), "stop", self.stop, "an empty stop string would stop at once; "
                "stop takes non-empty strings", rule="empty_entry")
        require(len(self.stop) <= MAX_STOP_STRINGS, "stop", len(self.stop),
                 f"stop holds {len(self.stop)} strings, at most {MAX_STOP_STRINGS} are taken "
                 f"(each is searched for at every step)")
        longest = max(map(len, self.stop), default=0)
        require(longest <= MAX_STOP_CHARS, "stop", longest,
                 f"a stop string of {longest} characters: at most {MAX_STOP_CHARS} are taken")
        require(not self.stop or _is_bool(self.detokenize, True), "stop", self.stop,
                "stop strings are matched on the output text, which detokenize=False does "
                "not make; use detokenize=True or stop_token_ids", rule="needs_detokenize")
        ids = _as_list("stop_token_ids", self.stop_token_ids, int)
        self.stop_token_ids = list(dict.fromkeys(ids))

    def _validate_logprobs_and_flags(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1  # vLLM: True means 1
            if value is not None:
                value = as_int(name, value, hint="an integer >= 0, or -1 (all)")
                require(value >= -1, name, value,
                        f"{name} must be >= 0, or -1 (the whole vocabulary), got {value}",
                        rule="minimum", bound=-1)
            setattr(self, name, value)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            check_bool(name, getattr(self, name))
        if self.skip_reading_prefix_cache is not None:
            check_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParameterError(f"output_kind must be a RequestOutputKind, got "
                            f"{self.output_kind!r}", parameter="output_kind",
                            value=self.output_kind)

    def _validate_token_constraints(self) -> None:
        self.logit_bias = _as_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, int)
        self.bad_words = list(dict.fromkeys(_as_list("bad_words", self.bad_words, str)))
        require(len(self.bad_words) <= MAX_STOP_STRINGS, "bad_words", len(self.bad_words),
                 f"bad_words holds {len(self.bad_words)} words, at most {MAX_STOP_STRINGS} are taken")
        require(all(self.bad_words), "bad_words", self.bad_words,
                 f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")


# ---------------------------------------------------------------------- field checks
# require / check_bool / as_int are public: a layer adding fields (vllm_api) checks them alike.

def require(condition: bool, parameter: str, value, message: str, rule: str | None = None,
            bound=None) -> None:
    """Raise ``ParameterError(message)`` with the structured fields unless ``condition``."""
    if not condition:
        raise ParameterError(message, parameter=parameter, value=value, rule=rule, bound=bound)


def _is_bool(value, expected: bool) -> bool:
    return isinstance(value, (bool, np.bool_)) and bool(value) is expected


def check_bool(name: str, value) -> None:
    require(isinstance(value, (bool, np.bool_)), name, value,
             f"{name} must be True or False, got {value!r}")


def as_int(name: str, value, hint: str | None = None) -> int:
    """``value`` as a Python int; bools, floats and strings are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ParameterError(f"{name} must be {hint or 'an integer'}, got {value!r} "
                             f"({type(value).__name__})", parameter=name, value=value)
    return int(value)


def _as_float(name: str, value) -> float:
    """``value`` as a float (range checks are the caller's); nan is refused here."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ParameterError(f"{name} must be a number, got {value!r} "
                             f"({type(value).__name__})", parameter=name, value=value)
    value = float(value)
    require(not math.isnan(value), name, value, f"{name} must be a finite number, got nan.")
    return value


def _as_list(name: str, values, item_type: type) -> list:
    """None -> []; a list / tuple of ``item_type`` -> a fresh list (ints checked as ints)."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, np.ndarray)):
        raise ParameterError(f"{name} must be a list of {item_type.__name__}, got "
                             f"{values!r}", parameter=name, value=values)
    require(len(values) <= MAX_LIST_ENTRIES, name, len(values),
            f"{name} holds {len(values)} entries, at most {MAX_LIST_ENTRIES} are taken")
    if item_type is int:
        bad = [v for v in values
               if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))]
        require(not bad, name, values, f"{name} must contain only integers, got {list(values)}.")
        return [int(v) for v in values]
    bad = [v for v in values if not isinstance(v, item_type)]
    require(not bad, name, values,
             f"{name} must contain only {item_type.__name__}, got {bad[:1]!r}")
    return list(values)


def _as_logit_bias(bias) -> dict[int, float] | None:
    """{token id (int or numeric string): finite float}."""
    if bias is None:
        return None
    require(isinstance(bias, dict), "logit_bias", bias,
             f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    require(len(bias) <= MAX_LIST_ENTRIES, "logit_bias", len(bias),
            f"logit_bias holds {len(bias)} entries, at most {MAX_LIST_ENTRIES} are taken")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, str) else as_int("logit_bias key", key)
        except (ValueError, ParameterError):
            raise ParameterError(f"logit_bias keys are token ids (ints, or strings of "
                                 f"digits), got {key!r}", parameter="logit_bias",
                                 value=[key], rule="key_type") from None
        out[token] = _as_float(f"logit_bias[{token}]", value)
        require(math.isfinite(out[token]), "logit_bias", bias,
                 f"logit_bias[{token}] must be finite, got {value}")
    return out


def _check_logprob_count(name: str, value: int | None, vocab_size: int, limit: int,
                         max_logprobs: int) -> None:
    if value is None or value == 0:
        return
    wanted = vocab_size if value == -1 else value
    require(wanted <= vocab_size, name, value,
             f"{name}={value} exceeds the vocabulary size {vocab_size}")
    if wanted > limit:
        raise LogprobsLimitError(name, value, wanted, limit, max_logprobs)


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise OutOfVocabularyError(name, bad, vocab_size)


def _tokenize_bad_words(words: list[str], tokenizer, vocab_size: int) -> list[list[int]] | None:
    """Each word as token ids, and after a space when that spelling is another token of the
    same length (so the word is banned at the start of the text and mid-text, as vLLM does)."""
    if not words:
        return None
    if tokenizer is None:
        raise ParameterError("bad_words need a tokenizer, but the engine has none (no "
                             "tokenizer in the checkpoint, or skip_tokenizer_init=True)",
                             parameter="bad_words", value=words)
    sequences: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        require(bool(plain), "bad_words", words,
                 f"bad_words entries must tokenize to at least one token; {word!r} does not")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    _check_token_ids("bad_words", [t for ids in sequences for t in ids], vocab_size)
    return sequences
