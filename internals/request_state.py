"""The engine's record of one request: its sequences (n of them), their text and logprobs, and
the ``RequestOutput`` built from them.

A request is what the caller submitted (one ``request_id``); each of its ``n`` sequences is a
``Sequence`` the scheduler runs on its own (child i's id is ``"{i}_{request_id}"`` when
n > 1, as in vLLM). Text is detokenized incrementally as tokens arrive, so stop strings are
found as soon as they complete.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from api.outputs import (CompletionOutput, IncrementalDetokenizer, PositionLogprobs, RequestOutput,
                     TokenTexts, logprob_dict)
from internals.sampler import TokenLogprobs
from api.sampling_params import RequestOutputKind, SamplingParams
from scheduler import Sequence


@dataclass(eq=False)  # identity: one record per sequence
class SequenceState:
    """What the engine keeps per sequence beyond its tokens."""

    index: int
    seq: Sequence
    request: RequestState  # the request this sequence is one of the n of
    detokenizer: IncrementalDetokenizer | None
    cumulative_logprob: float | None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None   # prompt tokens served from cache at first admission
    sent_tokens: int = 0                   # for DELTA outputs: what the caller has already seen
    sent_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.seq.is_finished

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        seq, finished = self.seq, self.seq.is_finished
        token_ids = seq.output_token_ids
        text = self.detokenizer.visible_text(finished) if self.detokenizer else None
        logprobs = seq.logprobs
        if kind is RequestOutputKind.DELTA:
            token_ids, logprobs, text = self._delta(token_ids, logprobs, text)
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob,
                                None if logprobs is None else list(logprobs),
                                seq.finish_reason if finished else None,
                                self.stop_reason if finished else None)

    def _delta(self, token_ids, logprobs, text):
        start, chars = self.sent_tokens, self.sent_chars
        self.sent_tokens = len(token_ids)
        self.sent_chars = len(text) if text is not None else 0
        return (token_ids[start:], None if logprobs is None else logprobs[start:],
                None if text is None else text[chars:])


@dataclass(eq=False)  # identity: one record per request
class RequestState:
    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_done: int = 0   # prompt positions whose logprobs are in (index 0 is None)
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def add_prompt_logprobs(self, rows: list[TokenLogprobs], texts: TokenTexts) -> None:
        """Logprobs of the next prompt positions (computed in order, chunk by chunk)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob (vLLM)
            self.prompt_logprobs_done = 1
        for row in rows:
            self.prompt_logprobs.append(logprob_dict(row.token_ids, row.logprobs, row.ranks,
                                                     texts(row.token_ids)))
        self.prompt_logprobs_done += len(rows)

    def output(self, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> RequestOutput:
        first = self.sequences[0]
        return RequestOutput(
            self.request_id, self.prompt_text, self.prompt_token_ids,
            [s.completion(kind) for s in self.sequences], self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens or 0, metrics=dict(self.metrics))


def record_token(state: SequenceState, token: int, logprobs: TokenLogprobs | None,
                 texts: TokenTexts) -> None:
    """Append the sampled token's logprobs (if asked) to the sequence's record."""
    if logprobs is None or state.seq.logprobs is None:
        return
    state.seq.logprobs.append(logprob_dict(logprobs.token_ids, logprobs.logprobs, logprobs.ranks,
                                           texts(logprobs.token_ids)))
    state.cumulative_logprob = (state.cumulative_logprob or 0.0) + logprobs.logprobs[0]
