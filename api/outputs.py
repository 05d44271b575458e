"""What a request returns in step14_5, shaped like vLLM's: ``RequestOutput`` / ``CompletionOutput``
with ``Logprob`` entries, plus the text side of a request: incremental detokenization and
stop strings with vLLM's semantics.

Stop strings: the text is cut before the matched string (after it with
``include_stop_str_in_output``), ``finish_reason`` is "stop" and ``stop_reason`` the string;
the token that completed it stays in ``token_ids``. A stop token id or EOS adds no text
unless ``include_stop_str_in_output``; ``stop_reason`` is the id (None for EOS).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from api.sampling_params import SamplingParams


class Logprob(float):
    """vLLM's ``Logprob(logprob, rank, decoded_token)``. It is also the float it holds, so
    code written for plain ``{token_id: float}`` dicts (sorting, arithmetic) keeps working."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


PositionLogprobs = dict[int, Logprob]

STREAM_FINISHED = object()  # vLLM's end-of-stream sentinel (offline calls never stream)


class RequestError(Exception):
    """vLLM's error for a request that failed inside the engine (here such a request
    finishes alone with ``finish_reason="error"`` instead)."""


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with ``n > 1`` has several)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None   # None unless logprobs were requested (vLLM)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None           # "stop", "length", "abort", "error" or None
    stop_reason: int | str | None = None       # the stop string or stop token id that ended it
    lora_request: object = None                # vLLM's; always None (no LoRA here)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state, shaped like vLLM's. ``.text``, ``.token_ids``, ``.finish_reason``
    and ``.logprobs`` are our shortcuts to ``outputs[0]`` (vLLM has none: use ``outputs[0]``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # vLLM's fields for features this engine lacks: always their "absent" values.
    lora_request: object = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict | None = None
    multi_modal_placeholders: dict = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs


# ---------------------------------------------------------------------- logprobs

class TokenTexts:
    """``decoded_token`` for logprob entries: each id decoded alone, once per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._texts]
        if missing:
            texts = self.tokenizer.batch_decode([[t] for t in missing])
            self._texts.update(zip(missing, texts))
        return [self._texts[t] for t in token_ids]


def logprob_dict(token_ids: list[int], values: list[float], ranks: list[int],
                 decoded: list[str | None]) -> PositionLogprobs:
    """One position's ``{token_id: Logprob}``; the first id (the chosen one) comes first and a
    repeated id (the chosen token also in the top-k) is kept once, as in vLLM."""
    out: PositionLogprobs = {}
    for token, value, rank, text in zip(token_ids, values, ranks, decoded):
        if token not in out:
            out[token] = Logprob(value, rank, text)
    return out


# ---------------------------------------------------------------------- text and stop strings

class IncrementalDetokenizer:
    """The output text of one sequence, grown one token at a time.

    Each token decodes a short window (the tokens since the last emitted text, plus the one
    before them for context) twice and appends the difference, so the cost per token does
    not grow with the output. Text whose last character is an incomplete UTF-8 sequence
    ("\\ufffd") waits for the next token. ``context_ids`` (e.g. the prompt's last tokens)
    seed the window, for tokenizers whose decoding of a token depends on what precedes it.
    """

    def __init__(self, tokenizer, params: SamplingParams, context_ids=()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or ())
        self.include_stop_str = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids = [int(t) for t in context_ids]
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)  # the context is read
        self.num_output_tokens = 0
        self.text = ""

    def update(self, token_id: int, stop_terminated: bool = False) -> str | None:
        """Add one generated token; returns the stop string it completed, if any.
        ``stop_terminated``: the token is EOS or a stop token id, whose text is left out
        unless ``include_stop_str_in_output``."""
        self.num_output_tokens += 1
        if stop_terminated and not self.include_stop_str:
            return None
        self.token_ids.append(int(token_id))
        new_chars = self._decode_new_text()
        if not new_chars or not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._check_stop_strings(new_chars)

    def visible_text(self, finished: bool) -> str:
        """The text to show now: while unfinished, the last characters that could still turn
        out to begin a stop string are held back (they would be cut if it completes)."""
        if finished or self.include_stop_str or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[:max(0, len(self.text) - hold)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self) -> int:
        """Append the text the new token completes; returns how many characters were added."""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return 0  # an incomplete character (or nothing visible yet): wait for more tokens
        self.text += after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return len(after) - len(before)

    def _check_stop_strings(self, new_chars: int) -> str | None:
        """Find the stop string that ends earliest in the new text and cut the text there."""
        best, best_start, best_end = None, 0, len(self.text) + 1
        for stop in self.stop:
            start = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if start != -1 and start + len(stop) < best_end:
                best, best_start, best_end = stop, start, start + len(stop)
        if best is not None:
            self.text = self.text[:best_end if self.include_stop_str else best_start]
        return best
