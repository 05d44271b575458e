"""The engine's request table and the bookkeeping after each forward: append the sampled
tokens, detokenize, decide which sequences finish, and hand outputs to whoever waits for them.

The one home of finishing and outputs: ``finish_reason`` is set through the scheduler (which
frees the blocks), timings and logprobs live on the records (requests.py), and every output
goes to its request's ``OutputSink``. The processor owns the request table and the records.
``process`` runs inside a step's commit: a tokenizer that raises there finishes its own
request with "error" and the rest goes on, so the commit is never left half done. A
constrained sequence's grammar matcher advances here with its accepted token (core/grammar.py):
the commit is the only place it moves, so a step that fails before it moves none.
"""
from __future__ import annotations

import time
import warnings

from core.model_runner import StepResult
from core.outputs import TokenTexts
from core.requests import RequestState, SequenceState
from core.sampling_params import RequestOutputKind
from scheduler import ScheduledChunk, Scheduler, Sequence

NO_TEXTS = TokenTexts(None)  # decoded_token is None where detokenize=False


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.token_texts = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState] = {}  # id -> its record
        self.seq_states: dict[Sequence, SequenceState] = {}
        self.generation_tokens = 0
        self.prompt_tokens = 0  # each request's prompt once, when it is first scheduled

    # ------------------------------------------------------------------ the table

    def add(self, state: RequestState) -> None:
        state.arrival_time = time.perf_counter()
        self.requests[state.request_id] = state
        for seq_state in state.sequences:
            self.seq_states[seq_state.seq] = seq_state
            self.scheduler.add(seq_state.seq)

    def is_live(self, request_id: str, state: RequestState | None = None) -> bool:
        """The id names a request still in the table (and, given ``state``, that one)."""
        found = self.requests.get(request_id)
        return found is not None and (state is None or found is state)

    def abort(self, request_id: str, state: RequestState | None = None) -> bool:
        """Cancel every sequence of a request; a generate() call waiting for it gets the
        aborted output (so it never waits forever). False if unknown or already finished
        (or, given ``state``, if the id now names another request)."""
        if not self.is_live(request_id, state):
            return False
        state = self.requests[request_id]
        for seq_state in state.sequences:
            if not seq_state.seq.is_finished:
                self.scheduler.abort(seq_state.seq)
                seq_state.finished_time = time.perf_counter()
        self._retire(state)
        if state.sink.takes_aborted:
            state.sink.put(state.output())
        return True

    def state_of(self, seq: Sequence) -> SequenceState:
        return self.seq_states[seq]

    def _retire(self, state: RequestState) -> None:
        del self.requests[state.request_id]
        for seq_state in state.sequences:
            self.seq_states.pop(seq_state.seq, None)

    # ------------------------------------------------------------------ after a forward

    def note_cached_tokens(self, chunks: list[ScheduledChunk]) -> None:
        """A sequence's first chunk starts after its cached prefix: vLLM's num_cached_tokens,
        and why the prefix ends there (its admitting lookup's stop). Its request's prompt counts
        once, then (not again after a preemption)."""
        for chunk in chunks:
            state = self.seq_states[chunk.seq]
            if state.num_cached_tokens is None:
                self.prompt_tokens += chunk.seq.num_prompt_tokens if state.index == 0 else 0
                state.num_cached_tokens = min(chunk.start, chunk.seq.num_prompt_tokens)
                state.cache_miss_reason = self.scheduler.prefix_cache.stop_of(chunk.seq)  # and why

    def process(self, result: StepResult) -> None:
        """Store prompt logprobs, append the sampled tokens, emit outputs to their sinks."""
        failed = self._store_prompt_logprobs(result.prompt_rows)
        touched = self._append_tokens(result)
        for state in dict.fromkeys(failed + touched):
            self._emit(state)

    def _store_prompt_logprobs(self, prompt_rows: list) -> list[RequestState]:
        failed = []
        for state, rows in prompt_rows:
            texts = self.token_texts if state.params.detokenize else NO_TEXTS
            if not self._guarded(state.sequences[0], lambda: state.add_prompt_logprobs(rows, texts)):
                failed.append(state)
        return failed

    def _append_tokens(self, result: StepResult) -> list[RequestState]:
        touched, now, sample = [], time.perf_counter(), result.sample
        for row, (seq_state, token) in enumerate(zip(result.sampled, sample.token_ids)):
            seq = seq_state.seq
            if seq.is_finished:
                continue  # it failed while its prompt logprobs were stored
            seq.append_token(token)
            self.generation_tokens += 1
            if seq_state.first_token_time is None:
                seq_state.first_token_time = now
            logprobs = sample.logprobs[row] if sample.logprobs is not None else None
            self._guarded(seq_state, lambda: self._after_token(seq_state, token, logprobs))
            touched.append(seq_state.request)
        return touched

    def _after_token(self, seq_state: SequenceState, token: int, logprobs) -> None:
        if seq_state.grammar is not None:  # the matcher moves here, in the commit, and only here
            seq_state.grammar.accept(token, seq_state.seq.request_id)
        texts = self.token_texts if seq_state.params.detokenize else NO_TEXTS
        seq_state.record_logprobs(logprobs, texts)
        reason = self._finish_reason(seq_state, token)
        if reason is not None:
            self._finish(seq_state, reason)

    def _guarded(self, seq_state: SequenceState, action) -> bool:
        """Run ``action`` for one sequence; if it raises (a tokenizer error), that sequence
        alone finishes with finish_reason "error" and the rest of the batch goes on."""
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001 -- any failure here is this request's alone
            warnings.warn(f"could not decode output tokens of request {seq_state.seq.request_id}: "
                          f"{exc!r}; it finishes with finish_reason 'error' and no text")
            seq_state.detokenizer = None
            if not seq_state.seq.is_finished:
                self._finish(seq_state, "error")
            return False

    def _finish_reason(self, seq_state: SequenceState, token: int) -> str | None:
        """vLLM's order: EOS, a stop token id, a stop string, then the length limits."""
        seq, params = seq_state.seq, seq_state.params
        may_stop = seq.num_output_tokens > params.min_tokens
        is_eos = not params.ignore_eos and token in self.eos_token_ids
        stop_token = may_stop and (is_eos or token in params.stop_token_ids)
        detok = seq_state.detokenizer
        stop_string = detok.update(token, stop_token) if detok is not None else None
        if stop_token:
            seq_state.stop_reason = None if is_eos else token
            return "stop"
        if stop_string is not None:
            seq_state.stop_reason = stop_string
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq_state: SequenceState, reason: str) -> None:
        self.scheduler.finish(seq_state.seq, reason)
        seq_state.finished_time = time.perf_counter()

    def _emit(self, state: RequestState) -> None:
        """An output per the request's kind: every step (CUMULATIVE, DELTA) or at the end."""
        if state.finished:
            self._retire(state)
        elif state.output_kind is RequestOutputKind.FINAL_ONLY:
            return
        state.sink.put(state.output())
