"""The engine's record of one request: its sequences (n of them), their text, logprobs and
timings, and the ``RequestOutput`` built from them.

A request is what the caller submitted (one ``request_id``); each of its ``n`` sequences is a
``Sequence`` the scheduler runs on its own (child i is labelled ``"{i}_{request_id}"`` when
n > 1, as in vLLM). Text is detokenized incrementally as tokens arrive, so stop strings are
found as soon as they complete. Everything here is written by the output processor
(output_processor.py) only.
"""
from __future__ import annotations

import weakref

from dataclasses import dataclass, field

from core.detokenizer import IncrementalDetokenizer
from core.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenTexts, logprob_dict
from core.sampler import TokenLogprobs
from core.sampling_params import RequestOutputKind, SamplingParams
from scheduler import Sequence


class Caller:
    """Held by a call that waits on a sink (``OutputSink(owner=...)``) for as long as it waits."""


class OutputSink:
    """Where a request's outputs go: the ``LLMEngine.step()`` caller's queue, or one
    ``generate()`` call's (which waits for its own requests to finish)."""

    def __init__(self, takes_aborted: bool = False, owner: object | None = None) -> None:
        self.outputs: list[RequestOutput] = []
        self.num_finished = 0
        # A generate() call waits for each of its requests, so an abort must reach it too;
        # step()'s caller aborted the request itself and gets nothing more (as in vLLM).
        self.takes_aborted = takes_aborted
        # The call waiting on this sink holds ``owner``; once it is gone, so is the caller (its
        # own clean-up may have been cut short by a second Ctrl-C) and nobody reads the sink.
        self._owner = None if owner is None else weakref.ref(owner)

    @property
    def abandoned(self) -> bool:
        return self._owner is not None and self._owner() is None

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        self.num_finished += output.finished

    def drain(self) -> list[RequestOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs


@dataclass(eq=False)  # identity: one record per sequence
class SequenceState:
    """What the engine keeps per sequence beyond its tokens; the sampler reads a step's rows
    through it (``sampling_params`` and the sequence's tokens)."""

    index: int
    seq: Sequence
    request: RequestState  # the request this sequence is one of the n of
    params: SamplingParams  # this sequence's own (child i of n gets seed + i)
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None = None  # per output token, when asked for
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None   # prompt tokens served from cache at first admission
    cache_miss_reason: str | None = None   # why that cached prefix ends there (a CacheMiss)
    first_token_time: float | None = None
    finished_time: float | None = None
    sent_tokens: int = 0                   # for DELTA outputs: what the caller has already seen
    sent_chars: int = 0
    grammar: object = None                 # a SequenceGrammar (core/grammar.py) when constrained

    @property
    def finished(self) -> bool:
        return self.seq.is_finished

    @property
    def sampling_params(self) -> SamplingParams:
        return self.params

    @property
    def tokens(self):
        return self.seq.tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens

    def record_logprobs(self, logprobs: TokenLogprobs | None, texts: TokenTexts) -> None:
        """Append the sampled token's logprobs (when the request asked for them)."""
        if logprobs is None or self.logprobs is None:
            return
        self.logprobs.append(logprob_dict(logprobs.token_ids, logprobs.logprobs, logprobs.ranks,
                                          texts(logprobs.token_ids)))
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs.logprobs[0]

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        seq, finished = self.seq, self.seq.is_finished
        token_ids = seq.output_token_ids
        text = self.detokenizer.visible_text(finished) if self.detokenizer else ""
        logprobs = self.logprobs
        if kind is RequestOutputKind.DELTA:
            token_ids, logprobs, text = self._delta(token_ids, logprobs, text)
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob,
                                None if logprobs is None else list(logprobs),
                                seq.finish_reason if finished else None,
                                self.stop_reason if finished else None)

    def _delta(self, token_ids, logprobs, text: str):
        start, chars = self.sent_tokens, self.sent_chars
        self.sent_tokens, self.sent_chars = len(token_ids), len(text)
        return token_ids[start:], None if logprobs is None else logprobs[start:], text[chars:]


@dataclass(eq=False)  # identity: one record per request
class RequestState:
    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind   # generate(): FINAL_ONLY; add_request(): the params'
    sink: OutputSink = None  # set by the engine when it queues the request
    arrival_time: float = 0.0
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob (vLLM)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    @property
    def prompt_logprobs_done(self) -> int:
        """Prompt positions whose logprobs are in (position 0 has none, so it counts as done)."""
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    def add_prompt_logprobs(self, rows: list[TokenLogprobs], texts: TokenTexts) -> None:
        """Logprobs of the next prompt positions (computed in order, chunk by chunk)."""
        for row in rows:
            self.prompt_logprobs.append(logprob_dict(row.token_ids, row.logprobs, row.ranks,
                                                     texts(row.token_ids)))

    def output(self) -> RequestOutput:
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            kind = RequestOutputKind.CUMULATIVE  # the final output carries everything
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        return RequestOutput(
            self.request_id, self.prompt_text, self.prompt_token_ids,
            [s.completion(kind) for s in self.sequences], self.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.sequences[0].num_cached_tokens or 0, metrics=self.metrics(),
            cache_miss_reason=self.sequences[0].cache_miss_reason)

    def metrics(self) -> dict:
        """Timings (perf_counter seconds): arrival, first token, finish, TTFT."""
        first = self.sequences[0]
        done = [s.finished_time for s in self.sequences if s.finished_time is not None]
        finished_time = max(done) if self.finished and done else None
        metrics = dict(arrival_time=self.arrival_time, first_token_time=first.first_token_time)
        if finished_time is not None:
            ttft_end = first.first_token_time or finished_time
            metrics.update(finished_time=finished_time, ttft=ttft_end - self.arrival_time)
        return metrics
