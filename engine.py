"""The engine of step14_5: ``LLMEngine`` owns the loop, ``LLM`` is vLLM's offline API on top.

One engine step (``LLMEngine.step``), read top to bottom:

1. ``scheduler.schedule()``  -- which tokens run: one per decoding sequence, then prefill chunks;
   admitting a sequence looks its prompt up in the prefix cache (prefix_cache.py, the chapter);
2. ``model_runner.run()``    -- one forward for all of them on the paged KV pool, then sampling;
3. ``scheduler.commit()``    -- only now, with forward and sampling done: advance each sequence
   and register the blocks it filled in the prefix cache (the chapter's ``_do_prefill_step``);
4. ``output_processor.process()`` -- append the tokens, finish sequences, emit outputs.

Requests and aborts may come from any thread: every change to the engine's state takes one
lock, so they land between steps, never inside one. ``hash_strategy="recompute"`` keeps the
chapter's "before" column runnable; it changes how hashes are obtained and nothing else.
"""
from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import numpy as np
import torch

from api.checkpoint_files import (eos_token_ids, generation_config, load_tokenizer, read_template,
                                  render_chat)
from api.config import EngineConfig
from api.engine_args import translate_engine_args
from api.beam import BEAM_SEARCH_REASON
from api.errors import refuse
from api.intake import ParamsContext, child_params, parse_prompt, prepare_params, reject_unsupported
from api.llm_extras import LLMExtras
from api.outputs import IncrementalDetokenizer, RequestOutput
from api.pooling import POOLING_REASON
from api.public import *  # noqa: F403 -- vLLM's public names, importable from here
from api.public import __all__ as _VLLM_NAMES
from api.sampling_params import RequestOutputKind, SamplingParams
from block_manager import BlockManager, KVCachePool
from internals import cpu_memory
from internals.cpu_threads import ThreadPolicy
from internals.kv_sizing import check_fits, num_kv_blocks, resolve_max_model_len
from internals.model_runner import ModelRunner
from internals.output_processor import OutputProcessor
from internals.request_state import OutputSink, RequestState, SequenceState
from internals.sampler import Sampler
from model import load_model
from prefix_cache import PrefixCache
from scheduler import Scheduler, SchedulerConfig, Sequence

__all__ = ["LLM", "LLMEngine", "Sequence", *_VLLM_NAMES]

DETOKENIZE_CONTEXT = 5  # prompt tokens the output text is decoded after (vLLM's offset)
SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                         "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


class LLMEngine(LLMExtras):
    """vLLM's ``LLMEngine``: requests in, ``step()`` by step, outputs out (per each request's
    ``output_kind``; vLLM's default, CUMULATIVE, is everything so far)."""

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        self.config = EngineConfig(**translate_engine_args(engine_args,
                                                           EngineConfig.__dataclass_fields__))
        self.device = torch.device(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # On CPU, compute with the cores other processes leave idle (internals/cpu_threads.py)
        # and keep freed memory for the next step's tensors (internals/cpu_memory.py).
        self.thread_policy = (ThreadPolicy(max_threads=self.config.num_threads)
                              if self.device.type == "cpu" else None)
        if self.device.type == "cpu":
            cpu_memory.keep_freed_memory()
        self.model = load_model(model, self.config.dtype, self.device, self.config.fast_paths)
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self._load_checkpoint_files(Path(model))
        self._build_kv_cache()
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.block_size,
                                        Sampler(self.device, self.config.seed, sorted(self.eos_token_ids),
                                                logprobs_mode=self.config.logprobs_mode),
                                        self.device)
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids,
                                                self.max_model_len)
        self._lock = threading.RLock()   # one step, or one change to the request table, at a time
        self._stream = OutputSink()      # outputs of add_request()'s requests: step() returns them
        self._auto_ids = itertools.count()
        self.steps = 0

    def _load_checkpoint_files(self, path: Path) -> None:
        self.model_path = path
        self.tokenizer = (None if self.config.skip_tokenizer_init
                          else load_tokenizer(Path(self.config.tokenizer or path)))
        self.generation_config = generation_config(path, self.config.generation_config,
                                                   self.config.override_generation_config)
        self.eos_token_ids = set(eos_token_ids(path, self.model_config))

    def _build_kv_cache(self) -> None:
        """The pool, sized once (internals/kv_sizing.py), and the three objects that manage it."""
        cfg = self.model_config
        self.max_model_len = resolve_max_model_len(self.config.max_model_len,
                                                   cfg.max_position_embeddings)
        self.num_blocks = num_kv_blocks(self.config, cfg, self.dtype, self.device, self.max_model_len)
        self.kv_cache = KVCachePool(cfg.num_layers, self.num_blocks, self.block_size,
                                    cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.block_manager = BlockManager(self.num_blocks, self.block_size)
        self.prefix_cache = (PrefixCache(self.block_manager, self.config.hash_strategy)
                             if self.config.enable_prefix_caching else None)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs,
                                                   self.config.max_num_batched_tokens),
                                   self.block_manager, self.prefix_cache)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One step; the outputs of ``add_request``'s requests (per their ``output_kind``),
        including any produced while a ``generate()`` call was stepping."""
        with self._lock:
            self._step()
            return self._stream.drain()

    def _step(self) -> None:
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress although requests are pending")
            return
        self.output_processor.note_cached_tokens(chunks)
        if self.thread_policy is not None:
            self.thread_policy.maybe_update()  # rate-limited: reads /proc every few seconds
        result = self.model_runner.run(chunks, self.output_processor.request_of)
        # Commit only once the forward and sampling succeeded: a step that raises leaves every
        # sequence as it was, to be scheduled again.
        self.scheduler.commit(chunks)
        self.steps += 1
        self.output_processor.process(result)

    def run_until_finished(self, sink: OutputSink, num_requests: int) -> None:
        """Step until ``num_requests`` of ``sink``'s requests have finished. Callers in other
        threads step too: whoever holds the lock runs one step for every request."""
        while sink.num_finished < num_requests:
            with self._lock:
                if sink.num_finished < num_requests:
                    self._step()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time=None, lora_request=None, priority: int = 0,
                    **unsupported) -> str:
        """Queue one request (applied between steps); its outputs come from ``step()``."""
        reject_unsupported(lora_request, priority, **unsupported)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        state, = self.add_requests([(prompt, params)], request_ids=[request_id])
        return state.request_id

    def add_requests(self, requests: list, output_kind: RequestOutputKind | None = None,
                     sink: OutputSink | None = None, request_ids=None) -> list[RequestState]:
        """Validate every (prompt, params) first, then queue them all: one bad request queues
        nothing. ``output_kind`` None: each request's own ``params.output_kind``; ``sink`` None:
        the outputs go to ``step()``'s caller."""
        sink = sink or self._stream
        with self._lock:
            ids = self._claim_ids(request_ids or [None] * len(requests))
            states = [self._make_request(rid, prompt, params, output_kind, sink)
                      for rid, (prompt, params) in zip(ids, requests)]
            for state in states:
                self.output_processor.add(state)
            return states

    def _claim_ids(self, wanted: list[str | None]) -> list[str]:
        """Explicit ids must be free; automatic ones skip every id in use or asked for (ids
        name requests only: a child sequence's "{i}_{id}" label never collides with anything)."""
        taken = set(self.output_processor.requests)
        explicit = [rid for rid in wanted if rid is not None]
        for rid in explicit:
            if rid in taken or explicit.count(rid) > 1:
                raise ValueError(f"request id {rid!r} is already in use")
        taken.update(explicit)
        ids = []
        for rid in wanted:
            if rid is None:
                rid = self._free_auto_id(taken)
                taken.add(rid)
            ids.append(rid)
        return ids

    def _free_auto_id(self, taken: set[str]) -> str:
        rid = str(next(self._auto_ids))
        while rid in taken:
            rid = str(next(self._auto_ids))
        return rid

    def _make_request(self, request_id: str, prompt, params, output_kind, sink) -> RequestState:
        """Everything that can fail about a request, before anything is queued or allocated."""
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        params = prepare_params(params or self.get_default_sampling_params(),
                                parsed.token_ids.size, self._params_context())
        check_fits(parsed.token_ids.size, params.max_tokens, self.max_model_len, self.block_size,
                   self.num_blocks)
        state = RequestState(request_id, parsed.text, parsed.token_ids.tolist(), params,
                             output_kind or params.output_kind, sink)
        root = self.prefix_cache.root_hash(parsed.cache_salt) if self.prefix_cache else 0
        for index, child in enumerate(child_params(params)):
            label = request_id if params.n == 1 else f"{index}_{request_id}"
            seq = Sequence(parsed.token_ids, child, request_id=label, cache_salt=parsed.cache_salt,
                           root_hash=root)
            state.sequences.append(SequenceState(index, seq, state, self._detokenizer(child, parsed.token_ids),
                                                 [] if child.logprobs is not None else None))
        return state

    def _params_context(self) -> ParamsContext:
        return ParamsContext(self.model_config.vocab_size, self.config.max_logprobs,
                             self.max_model_len, self.tokenizer)

    def _detokenizer(self, params: SamplingParams, prompt_ids: np.ndarray) -> IncrementalDetokenizer | None:
        """Text starts from the prompt's last tokens, as vLLM's does: a word-level or
        SentencePiece tokenizer then gives the first word its leading space."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, params, prompt_ids[-DETOKENIZE_CONTEXT:])

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a queued or running request (all its sequences), between steps; its blocks
        return (cached ones stay reusable). False if it is unknown or already finished."""
        with self._lock:
            return self.output_processor.abort(str(request_id))

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or its output has not been returned yet."""
        with self._lock:
            return self.scheduler.has_unfinished or bool(self._stream.outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ------------------------------------------------------------------ vLLM's accessors

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's sampling defaults (generation_config.json: temperature, top_p,
        top_k, min_p, penalties, max_new_tokens -> max_tokens), as vLLM reads them."""
        found = {k: self.generation_config[k] for k in SAMPLING_DEFAULT_KEYS
                 if self.generation_config.get(k) is not None}
        if "max_new_tokens" in found:
            found["max_tokens"] = found.pop("max_new_tokens")
        return SamplingParams(**found)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached-and-free blocks; True if the cache is now empty (as vLLM's). With
        ``reset_running_requests``, running sequences are preempted first (they recompute)."""
        with self._lock:
            if self.prefix_cache is None:
                return True
            if reset_running_requests:
                for seq in list(reversed(self.scheduler.running)):
                    self.scheduler.preempt(seq)
            return self.prefix_cache.reset()

    def replace_prefix_cache(self, prefix_cache: PrefixCache | None) -> None:
        """Swap in another prefix cache (a learner's own variant; the exercises do), between steps."""
        with self._lock:
            self.prefix_cache = self.scheduler.prefix_cache = prefix_cache

    @property
    def engine_core(self) -> "LLMEngine":
        """vLLM's engine core is another process; here it is this engine (``shutdown()``)."""
        return self

    def shutdown(self) -> None:
        """Abort every request still in the engine (vLLM's tests call it in clean-up)."""
        for request_id in list(self.output_processor.requests):
            self.abort(request_id)

    def stats(self) -> dict:
        """Cumulative counters over this engine's life (prefix-cache figures in tokens)."""
        with self._lock:
            sched, bm, pc = self.scheduler.stats, self.block_manager, self.prefix_cache
            return dict(
                generation_tokens=self.output_processor.generation_tokens,
                steps=self.steps,
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


def _engine_attribute(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.llm_engine, name), doc=doc)


class LLM(LLMExtras):
    """Offline inference on a local Hugging Face checkpoint: ``LLM(model_dir).generate(prompts)``.

    A thin layer on ``self.llm_engine``. The learner's handles: ``llm.prefix_cache`` (the
    chapter), ``llm.scheduler`` and ``llm.block_manager`` (the pool)."""

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        self.llm_engine = LLMEngine(model, **engine_args)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The chapter's PrefixCache (None when off); assign one to swap in your own."""
        return self.llm_engine.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, prefix_cache: PrefixCache | None) -> None:
        self.llm_engine.replace_prefix_cache(prefix_cache)

    scheduler = _engine_attribute("scheduler", "The Scheduler: waiting and running sequences.")
    block_manager = _engine_attribute("block_manager", "The BlockManager: the pool's blocks.")
    config = _engine_attribute("config", "The EngineConfig.")
    model = _engine_attribute("model", "The CausalLM (model.py).")
    model_config = _engine_attribute("model_config", "The model's ModelConfig.")
    tokenizer = _engine_attribute("tokenizer", "The Hugging Face tokenizer (None without one).")
    block_size = _engine_attribute("block_size", "Tokens per KV block.")
    num_blocks = _engine_attribute("num_blocks", "Blocks in the KV pool.")
    max_model_len = _engine_attribute("max_model_len", "Longest prompt + output allowed.")
    dtype = _engine_attribute("dtype", "The model's compute dtype.")
    model_path = _engine_attribute("model_path", "The checkpoint directory.")
    device = _engine_attribute("device", "The device the model runs on.")

    # ------------------------------------------------------------------ generate and chat

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, *,
                 lora_request=None, priority=None, **unsupported) -> list[RequestOutput]:
        """Run prompts (strings, prompt dicts or token-id lists) to completion; outputs in
        input order. ``sampling_params``: one for all, a list (one per prompt), or None (the
        checkpoint's defaults, ``get_default_sampling_params()``). Safe to call from several
        threads at once: the calls share steps."""
        reject_unsupported(lora_request, priority, **unsupported)
        prompts = _as_prompt_list(prompts)
        sink = OutputSink(takes_aborted=True)
        states = self.llm_engine.add_requests(list(zip(prompts, _params_list(sampling_params, prompts))),
                                              RequestOutputKind.FINAL_ONLY, sink)
        try:
            self._run(sink, len(states), use_tqdm)
        finally:
            for state in states:  # on an error, leave nothing of this call behind
                self.llm_engine.abort(state.request_id)
        order = {state.request_id: i for i, state in enumerate(states)}
        return sorted(sink.drain(), key=lambda out: order[out.request_id])

    def _run(self, sink: OutputSink, num_requests: int, use_tqdm: bool) -> None:
        if not use_tqdm:
            return self.llm_engine.run_until_finished(sink, num_requests)
        from tqdm.auto import tqdm
        with tqdm(total=num_requests, desc="generate", unit="req", dynamic_ncols=True) as bar:
            while sink.num_finished < num_requests:
                self.llm_engine.run_until_finished(sink, sink.num_finished + 1)
                bar.update(sink.num_finished - bar.n)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, lora_request=None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools=None, chat_template_kwargs=None,
             **unsupported) -> list[RequestOutput]:
        """vLLM's ``chat``: one conversation (a list of {"role", "content"} dicts) or a list of
        them, rendered with the tokenizer's chat template (or ``chat_template``), generated."""
        unsupported.pop("chat_template_content_format", None)  # plain-text contents only
        reject_unsupported(lora_request, None, **unsupported)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = read_template(chat_template or self.config.chat_template)
        prompts = [render_chat(self.tokenizer, c, template, add_generation_prompt,
                               continue_final_message, tools, chat_template_kwargs or {})
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------------------------ the request loop

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. ``step()`` returns its output once finished."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        state, = self.llm_engine.add_requests([(prompt, sampling_params)],
                                              RequestOutputKind.FINAL_ONLY, request_ids=[request_id])
        return state.request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of ``add_request``'s requests that finished."""
        return self.llm_engine.step()

    def abort(self, request_id: str) -> bool:
        return self.llm_engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    # vLLM answers a call its model cannot serve with ValueError; so does this engine.
    def beam_search(self, *args, **kwargs):
        refuse("beam search", BEAM_SEARCH_REASON)

    def encode(self, *args, **kwargs):
        refuse("pooling (encode / embed / classify / score)", POOLING_REASON)

    embed = classify = score = encode


def _params_list(sampling_params, prompts: list) -> list:
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        return list(sampling_params)
    return [sampling_params] * len(prompts)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict, np.ndarray, torch.Tensor)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [prompts]  # one prompt given as a flat list of token ids
    return prompts
