"""The engine of step14_5: ``LLM`` and its step loop, behind vLLM's offline API.

One engine step: schedule -> one model forward for every scheduled token -> sample ->
commit (advance each sequence, cache the blocks it filled) -> append tokens -> return the
finished requests. The chapter itself -- the chain hash, the lookup, the save -- lives in
prefix_cache.py; the scheduler (scheduler.py) calls it when it admits a sequence and when
it commits a step. ``hash_strategy="recompute"`` keeps the chapter's "before" column
runnable; it changes how hashes are obtained and nothing else.

The API is vLLM's: ``LLM(model, **engine_args)`` (engine_args.py sorts vLLM's arguments),
``generate`` / ``chat`` with ``SamplingParams``, ``LLMEngine`` / ``EngineArgs`` for a
request-level loop, ``TokensPrompt`` / ``TextPrompt``. Intake (intake.py) checks a request
completely before it is queued; after that a request that fails anyway (a tokenizer error)
finishes alone with ``finish_reason="error"``.
"""
from __future__ import annotations

import itertools
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from block_manager import BlockManager, KVCachePool
from api.checkpoint_files import (
    eos_token_ids,
    generation_config,
    load_tokenizer,
    read_template,
    render_chat,
)
from internals.cpu_threads import ThreadPolicy
from api.config import EngineConfig
from api.engine_args import EngineArgs, translate_engine_args
from api.llm_extras import LLMExtras
from api.intake import (
    ParamsContext,
    TextPrompt,
    TokensPrompt,
    child_params,
    parse_prompt,
    prepare_params,
)
from internals.attention import SeqChunk
from model import load_model
from api.outputs import (
    CompletionOutput,
    IncrementalDetokenizer,
    Logprob,
    RequestOutput,
    TokenTexts,
)
from prefix_cache import PrefixCache
from internals.request_state import RequestState, SequenceState, record_token
from internals.sampler import Sampler, SamplerOutput, prompt_logprobs
from api.sampling_params import RequestOutputKind, SamplingParams
from scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt",
           "Sequence"]

NO_TEXTS = TokenTexts(None)  # decoded_token is None where detokenize=False
DETOKENIZE_CONTEXT = 5  # prompt tokens the output text is decoded after (vLLM's offset)
SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                         "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


class LLM(LLMExtras):
    """Offline inference on a local Hugging Face checkpoint: ``LLM(model_dir).generate(prompts)``."""

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        self.config = EngineConfig(**translate_engine_args(engine_args,
                                                           EngineConfig.__dataclass_fields__))
        self.device = torch.device(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # On CPU, compute with the cores other processes leave idle (see cpu_threads.py).
        self.thread_policy = (ThreadPolicy(max_threads=self.config.num_threads)
                              if self.device.type == "cpu" else None)
        self.model, _ = load_model(model, self.config.dtype, self.device, self.config.fast_paths)
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.model_path = Path(model)
        self.tokenizer = (None if self.config.skip_tokenizer_init
                          else load_tokenizer(Path(self.config.tokenizer or model)))
        self.generation_config = generation_config(self.model_path, self.config.generation_config,
                                                   self.config.override_generation_config)
        self.eos_token_ids = set(eos_token_ids(self.model_path, self.model_config))
        self.max_model_len = self._resolve_max_model_len()
        self.kv_cache = self._allocate_kv_cache()
        self.block_manager = BlockManager(self.num_blocks, self.block_size)
        self.prefix_cache = (PrefixCache(self.block_manager, self.config.hash_strategy)
                             if self.config.enable_prefix_caching else None)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs,
                                                   self.config.max_num_batched_tokens),
                                   self.block_manager, self.prefix_cache)
        self.sampler = Sampler(self.device, self.config.seed, sorted(self.eos_token_ids))
        self._init_request_tables()

    def _init_request_tables(self) -> None:
        self._counters = dict(generation_tokens=0, steps=0)
        self._request_ids = itertools.count()
        self._token_texts = TokenTexts(self.tokenizer)
        self._states: dict[str, RequestState] = {}       # request id -> its record
        self._seq_states: dict[Sequence, SequenceState] = {}  # its request: .request
        self._requests: dict[str, Sequence] = {}         # sequence id -> queued / running sequence
        self._unclaimed: list[RequestOutput] = []

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ------------------------------------------------------------------ set-up

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} is greater than the checkpoint's "
                             f"max_position_embeddings ({limit}); positions beyond it were "
                             f"never trained (vLLM raises here too)")
        return wanted or limit

    def _allocate_kv_cache(self) -> KVCachePool:
        cfg = self.model_config
        per_block = KVCachePool.bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads,
                                                cfg.head_dim, self.dtype)
        self.num_blocks = self.config.num_kv_blocks or self._blocks_from_budget(per_block)
        return KVCachePool(cfg.num_layers, self.num_blocks, self.block_size, cfg.num_kv_heads,
                           cfg.head_dim, self.dtype, self.device)

    def _blocks_from_budget(self, per_block: int) -> int:
        budget = self.config.kv_cache_memory or self._default_kv_budget()
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"KV budget of {int(budget)} bytes (kv_cache_memory) is too small for one "
                             f"block of {self.block_size} tokens in each of "
                             f"{self.model_config.num_layers} layers ({per_block} bytes)")
        # More blocks than max_num_seqs full-length sequences can use would only waste memory.
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return min(blocks, useful)

    def _default_kv_budget(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free * self.config.gpu_memory_utilization
        return _available_ram() * self.config.cpu_kv_cache_fraction

    def reset_prefix_cache(self) -> bool:
        """Forget cached-and-free blocks; True if the cache is now empty (as vLLM's)."""
        return self.prefix_cache.reset() if self.prefix_cache else True

    # ------------------------------------------------------------------ vLLM's accessors

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def llm_engine(self) -> "LLMEngine":
        """vLLM's ``LLM.llm_engine``: the request-level interface of this same engine."""
        return LLMEngine(self)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's sampling defaults (generation_config.json: temperature, top_p,
        top_k, min_p, penalties, max_new_tokens -> max_tokens), as vLLM reads them."""
        found = {k: self.generation_config[k] for k in SAMPLING_DEFAULT_KEYS
                 if self.generation_config.get(k) is not None}
        if "max_new_tokens" in found:
            found["max_tokens"] = found.pop("max_new_tokens")
        return SamplingParams(**found)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. Validates before anything is queued."""
        state = self._make_request(prompt, sampling_params, request_id)
        self._enqueue(state)
        return state.request_id

    def _make_request(self, prompt, sampling_params, request_id: str | None = None) -> RequestState:
        """Everything that can fail about a request, before anything is queued or allocated."""
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = prepare_params(sampling_params, parsed.token_ids.size, self._params_context())
        self._check_fits(parsed.token_ids.size, params.max_tokens)
        state = RequestState(self._new_request_id(request_id, params.n), parsed.text,
                             parsed.token_ids.tolist(), params)
        root = self.prefix_cache.root_hash(parsed.cache_salt) if self.prefix_cache else 0
        for index, child in enumerate(child_params(params)):
            seq_id = state.request_id if params.n == 1 else f"{index}_{state.request_id}"
            seq = Sequence(parsed.token_ids, child, request_id=seq_id, cache_salt=parsed.cache_salt,
                           root_hash=root, prompt_text=parsed.text)
            state.sequences.append(SequenceState(index, seq, state, self._detokenizer(child, parsed.token_ids),
                                                 None if child.logprobs is None else 0.0))
        return state

    def _params_context(self) -> ParamsContext:
        return ParamsContext(self.model_config.vocab_size, self.config.max_logprobs,
                             self.max_model_len, self.tokenizer)

    def _new_request_id(self, request_id, n: int) -> str:
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self._states:
                request_id = str(next(self._request_ids))
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        seq_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        if request_id in self._states or any(s in self._requests for s in seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                             f"= {total} exceeds max_model_len {self.max_model_len}")
        needed = -(-(total - 1) // self.block_size)  # the last generated token needs no K/V slot
        if needed > self.num_blocks:
            raise ValueError(f"request needs {needed} KV blocks (prompt + max_tokens = {total} "
                             f"tokens) but the whole pool has {self.num_blocks}; raise num_kv_blocks")

    def _detokenizer(self, params: SamplingParams, prompt_ids: np.ndarray) -> IncrementalDetokenizer | None:
        """Text starts from the prompt's last tokens, as vLLM's does: a word-level or
        SentencePiece tokenizer then gives the first word its leading space."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, params, prompt_ids[-DETOKENIZE_CONTEXT:])

    def _enqueue(self, state: RequestState) -> None:
        now = time.perf_counter()
        state.metrics["arrival_time"] = now
        self._states[state.request_id] = state
        for seq_state in state.sequences:
            seq = seq_state.seq
            seq.arrival_time = now
            self._requests[seq.request_id] = seq
            self._seq_states[seq] = seq_state
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Cancel a queued or running request (all its sequences); its blocks return (cached
        ones stay reusable). False if it is unknown or already finished."""
        state = self._states.pop(str(request_id), None)
        if state is None:
            return False
        for seq_state in state.sequences:
            seq = seq_state.seq
            if not seq.is_finished:
                self.scheduler.abort(seq)
            self._forget_sequence(seq)
        return True

    def _forget_sequence(self, seq: Sequence) -> None:
        self._requests.pop(seq.request_id, None)
        self._seq_states.pop(seq, None)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or has finished with its output not yet returned."""
        return self.scheduler.has_unfinished or bool(self._unclaimed)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward for all scheduled tokens, sample, append; return finished.

        Also returns requests (from ``add_request``) that finished inside a ``generate()`` call.
        """
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + self._step()

    def _step(self, stream: bool = False) -> list[RequestOutput]:
        """One step; the finished requests' outputs (and, with ``stream``, an output for every
        request that got a token, per its ``output_kind``)."""
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress although requests are pending")
            return []
        self._note_cached_tokens(chunks)
        if self.thread_policy is not None:
            self.thread_policy.maybe_update()  # rate-limited: reads /proc every few seconds
        plan = _LogitsPlan.build(chunks, self._seq_states)
        logits = self._run_model(chunks, plan.logits_index)
        sampled = [c.seq for c in chunks if c.completes_sequence]
        sample = self.sampler(logits if plan.samples_every_row else logits[plan.sample_rows],
                              sampled)
        prompt_rows = self._prompt_logprob_rows(logits, plan)
        # Commit only once the forward and sampling succeeded: a step that raises leaves every
        # sequence as it was, to be scheduled again.
        self.scheduler.commit(chunks)
        self._counters["steps"] += 1
        failed = self._store_prompt_logprobs(prompt_rows)
        touched = self._append_tokens(sampled, sample)
        return self._outputs(list(dict.fromkeys(failed + touched)), stream)

    def _note_cached_tokens(self, chunks: list[ScheduledChunk]) -> None:
        """A sequence's first chunk starts after its cached prefix: vLLM's num_cached_tokens."""
        for chunk in chunks:
            state = self._seq_states[chunk.seq]
            if state.num_cached_tokens is None:
                state.num_cached_tokens = min(chunk.seq.num_computed_tokens,
                                              chunk.seq.num_prompt_tokens)

    def _run_model(self, chunks: list[ScheduledChunk], logits_index: list[int]) -> torch.Tensor:
        seq_chunks = [SeqChunk(c.seq.num_computed_tokens, c.num_tokens, c.seq.block_table)
                      for c in chunks]
        input_ids = np.concatenate([c.seq.tokens[s.start:s.start + s.length]
                                    for c, s in zip(chunks, seq_chunks)])
        meta = self.model.prepare(seq_chunks, self.block_size)
        return self.model(torch.from_numpy(input_ids).to(self.device), meta, self.kv_cache,
                          torch.tensor(logits_index, dtype=torch.long, device=self.device))

    def _prompt_logprob_rows(self, logits: torch.Tensor, plan: "_LogitsPlan") -> list:
        rows = []
        for state, first_row, positions in plan.prompt_rows:
            seq = state.sequences[0].seq
            targets = seq.tokens[positions.start + 1:positions.stop + 1]
            part = logits[first_row:first_row + len(positions)]
            rows.append((state, prompt_logprobs(part, targets, state.params.prompt_logprobs)))
        return rows

    def _store_prompt_logprobs(self, prompt_rows: list) -> list[RequestState]:
        """Store each request's new prompt logprobs; returns the requests that failed doing so."""
        failed = []
        for state, rows in prompt_rows:
            texts = self._token_texts if state.params.detokenize else NO_TEXTS
            if not self._guarded(state.sequences[0], lambda: state.add_prompt_logprobs(rows, texts)):
                failed.append(state)
        return failed

    def _append_tokens(self, seqs: list[Sequence], sample: SamplerOutput) -> list[RequestState]:
        touched = []
        now = time.perf_counter()
        for row, (seq, token) in enumerate(zip(seqs, sample.token_ids)):
            if seq.is_finished:
                continue  # it failed while its prompt logprobs were stored
            seq.append_token(token)
            self._counters["generation_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq_state = self._seq_states[seq]
            logprobs = sample.logprobs[row] if sample.logprobs is not None else None
            self._guarded(seq_state, lambda: self._after_token(seq_state, token, logprobs))
            touched.append(seq_state.request)
        return touched

    def _after_token(self, seq_state: SequenceState, token: int, logprobs) -> None:
        texts = self._token_texts if seq_state.seq.sampling_params.detokenize else NO_TEXTS
        record_token(seq_state, token, logprobs, texts)
        reason = self._finish_reason(seq_state, token)
        if reason is not None:
            self._finish(seq_state.seq, reason)

    def _guarded(self, seq_state: SequenceState, action) -> bool:
        """Run ``action`` for one sequence; if it raises (a tokenizer error), that sequence
        alone finishes with finish_reason "error" and the rest of the batch goes on."""
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001 -- any failure here is this request's alone
            seq = seq_state.seq
            warnings.warn(f"could not decode output tokens of request {seq.request_id}: {exc!r}; "
                          f"it finishes with finish_reason 'error' and text None")
            seq_state.detokenizer = None
            if not seq.is_finished:
                self._finish(seq, "error")
            return False

    def _finish_reason(self, seq_state: SequenceState, token: int) -> str | None:
        """vLLM's order: EOS, a stop token id, a stop string, then the length limits."""
        seq, params = seq_state.seq, seq_state.seq.sampling_params
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

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.finished_time = time.perf_counter()
        self._requests.pop(seq.request_id, None)

    def _outputs(self, states: list[RequestState], stream: bool) -> list[RequestOutput]:
        outputs = []
        for state in states:
            kind = state.params.output_kind if stream else RequestOutputKind.FINAL_ONLY
            if state.finished:
                outputs.append(self._final_output(state, kind))
            elif kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(state.output(kind))
        return outputs

    def _final_output(self, state: RequestState, kind: RequestOutputKind) -> RequestOutput:
        self._states.pop(state.request_id, None)
        for seq_state in state.sequences:
            self._forget_sequence(seq_state.seq)
        first = state.sequences[0].seq
        finished_time = max(s.seq.finished_time or 0.0 for s in state.sequences)
        state.metrics.update(first_token_time=first.first_token_time, finished_time=finished_time,
                             ttft=(first.first_token_time or finished_time) - first.arrival_time)
        return state.output(RequestOutputKind.CUMULATIVE if kind is RequestOutputKind.FINAL_ONLY
                            else kind)

    # ------------------------------------------------------------------ generate and chat

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, *,
                 lora_request=None, priority=None, **unsupported) -> list[RequestOutput]:
        """Run prompts (strings, prompt dicts or token-id lists) to completion; outputs in
        input order. ``sampling_params``: one for all, a list (one per prompt), or None (the
        checkpoint's defaults, ``get_default_sampling_params()``)."""
        _reject_request_extras(lora_request, priority, unsupported)
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        states = [self._make_request(p, sp) for p, sp in zip(prompts, params)]  # validate all first
        for state in states:
            self._enqueue(state)
        order = {state.request_id: i for i, state in enumerate(states)}
        results: list[RequestOutput | None] = [None] * len(states)
        try:
            self._run_until_done(order, results, use_tqdm)
        finally:
            for state in states:  # on an error, leave nothing of this call behind
                if state.request_id in self._states:
                    self.abort(state.request_id)
        return results

    def _run_until_done(self, order: dict, results: list, use_tqdm: bool) -> None:
        bar = _progress_bar(len(results), use_tqdm)
        start, tokens_at_start = time.perf_counter(), self._counters["generation_tokens"]
        remaining = len(results)
        while remaining:
            for out in self._step():
                if out.request_id not in order:
                    self._unclaimed.append(out)  # an add_request() caller's: its next step() has it
                    continue
                results[order[out.request_id]] = out
                remaining -= 1
                bar.update(1)
            elapsed = time.perf_counter() - start
            rate = (self._counters["generation_tokens"] - tokens_at_start) / max(elapsed, 1e-9)
            bar.set_postfix_str(f"{rate:.1f} out tok/s", refresh=False)
        bar.close()

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, lora_request=None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools=None, chat_template_kwargs=None,
             **unsupported) -> list[RequestOutput]:
        """vLLM's ``chat``: one conversation (a list of {"role", "content"} dicts) or a list of
        them, rendered with the tokenizer's chat template (or ``chat_template``), generated."""
        unsupported.pop("chat_template_content_format", None)  # plain-text contents only
        _reject_request_extras(lora_request, None, unsupported)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = read_template(chat_template or self.config.chat_template)
        prompts = [render_chat(self.tokenizer, c, template, add_generation_prompt,
                               continue_final_message, tools, chat_template_kwargs or {})
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    # vLLM answers a call its model cannot serve with ValueError; so does this engine.
    def beam_search(self, *args, **kwargs):
        raise ValueError("beam search is not supported by this engine")

    def encode(self, *args, **kwargs):
        raise ValueError("pooling (encode / embed / classify / score) is not supported: "
                         "this engine runs generative models only")

    embed = classify = score = encode

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Cumulative counters over this LLM's life (prefix-cache figures in tokens)."""
        sched, bm, pc = self.scheduler.stats, self.block_manager, self.prefix_cache
        return dict(
            self._counters,
            hash_computations=pc.hash_computations if pc else 0,
            prompt_tokens_computed=sched.prompt_tokens_computed,
            prompt_tokens_cached=sched.prompt_tokens_cached,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            prefix_cache_hit_rate=sched.prefix_cache_hits / max(sched.prefix_cache_queries, 1),
            preemptions=sched.preemptions,
            evictions=pc.num_evictions if pc else 0,
            num_blocks=bm.num_blocks,
            blocks_in_use=bm.num_blocks_in_use,
            blocks_cached=pc.num_cached_blocks if pc else 0,
            free_blocks=bm.num_free_blocks,
        )


@dataclass
class _LogitsPlan:
    """Which packed positions of a step need logits: each sampled sequence's last position,
    and the prompt positions of requests that asked for prompt logprobs."""

    logits_index: list[int]
    sample_rows: list[int]
    prompt_rows: list[tuple[RequestState, int, range]]  # (request, first logits row, positions)

    @property
    def samples_every_row(self) -> bool:
        """Every logits row is sampled, in order: the sampler takes the logits without a copy
        (a [batch, vocab] gather costs 1-5 ms per decode step on CPU)."""
        return len(self.sample_rows) == len(self.logits_index)

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], seq_states: dict) -> "_LogitsPlan":
        plan, offset = cls([], [], []), 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            request = seq_states[seq].request
            positions = _prompt_positions(request, seq, start, start + chunk.num_tokens)
            if positions:
                plan.prompt_rows.append((request, len(plan.logits_index), positions))
                plan.logits_index += [offset + p - start for p in positions]
            if chunk.completes_sequence:
                plan.sample_rows.append(len(plan.logits_index))
                plan.logits_index.append(offset + chunk.num_tokens - 1)
            offset += chunk.num_tokens
        return plan


def _prompt_positions(state: RequestState, seq: Sequence, start: int, end: int) -> range:
    """Positions p in [start, end) whose logits score prompt token p + 1 and are still missing
    (only the request's first sequence computes them, once, even if it is preempted)."""
    if state.params.prompt_logprobs is None or seq is not state.sequences[0].seq:
        return range(0)
    first_missing = max(state.prompt_logprobs_done, 1) - 1
    return range(max(start, first_missing), min(end, seq.num_prompt_tokens - 1))


class LLMEngine:
    """vLLM's ``LLMEngine``: a thin request-level layer on an ``LLM``. ``step()`` returns an
    output for every request that got a token (per its ``output_kind``; vLLM's default,
    CUMULATIVE, is everything so far, with ``finished`` telling when it is done)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_ignored) -> "LLMEngine":
        return cls(LLM(engine_args.model, **engine_args.kwargs))

    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time=None,
                    lora_request=None, priority: int = 0, **unsupported) -> str:
        _reject_request_extras(lora_request, priority, unsupported)
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        return self.llm.add_request(prompt, params, request_id=request_id)

    def step(self) -> list[RequestOutput]:
        unclaimed, self.llm._unclaimed = self.llm._unclaimed, []
        return unclaimed + self.llm._step(stream=True)

    def has_unfinished_requests(self) -> bool:
        return self.llm.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.llm._states)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.llm.abort(request_id)

    def get_tokenizer(self):
        return self.llm.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()


def _reject_request_extras(lora_request, priority, unsupported: dict) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: this engine has no LoRA adapters")
    priorities = priority if isinstance(priority, (list, tuple)) else [priority]
    if any(p not in (None, 0) for p in priorities):
        raise ValueError("priority is not supported: requests are served first come, first "
                         "served (vLLM too raises without scheduling_policy='priority')")
    for name, value in unsupported.items():
        if value is not None:
            raise TypeError(f"{name} is not supported by this engine")


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict, np.ndarray, torch.Tensor)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [prompts]  # one prompt given as a flat list of token ids
    return prompts


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", disable=not enabled, dynamic_ncols=True)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
