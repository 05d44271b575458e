"""What a request returns in step14_5, shaped like vLLM's so code moves to vLLM unchanged:
``RequestOutput`` / ``CompletionOutput`` with ``Logprob`` entries, and the logprob dicts.

Stop strings (core/detokenizer.py): the text is cut before the matched string (after it with
``include_stop_str_in_output``), ``finish_reason`` is "stop" and ``stop_reason`` the string;
the token that completed it stays in ``token_ids``. A stop token id or EOS adds no text
unless ``include_stop_str_in_output``; ``stop_reason`` is the id (None for EOS).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    # Ours (vLLM has none): why the cached prefix ends where it does, at the first admission,
    # beside num_cached_tokens. A str (prefix_cache.CacheMiss): its ``.reason`` names the kind.
    cache_miss_reason: str | None = None
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
