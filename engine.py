"""The engine of step14_5: ``EngineCore``, the loop the chapter's steps run in -- and, at the
end of this file, the engine's public face (``from engine import LLM, SamplingParams``, read as
vLLM's ``from vllm import LLM, SamplingParams``: the same script moves to vLLM unchanged).

One step (``EngineCore.step``), read top to bottom:

1. ``scheduler.schedule()``  -- the plan: which tokens run (one per decoding sequence, then
   prefill chunks), which waiting sequences are admitted with which blocks; admitting looks
   the prompt up in the prefix cache (prefix_cache.py, the chapter);
2. ``model_runner.run()``    -- one forward for all of them on the paged KV pool, then sampling;
3. ``scheduler.commit()``    -- only now, with forward and sampling done: admit, advance each
   sequence and register the blocks it filled in the prefix cache (the chapter's
   ``_do_prefill_step``); then ``output_processor.process()`` appends the tokens, finishes
   sequences, emits outputs.

Nothing is lost, by construction rather than by copies: planning changes nothing a failure
could leave wrong (only preemptions and evictions, which the forward needs done and which hold
whether or not it succeeds), the forward changes only K/V slots no committed state points at,
and the commit runs no user code and holds Ctrl-C until it is whole ("interrupts" below). A
step that raises anywhere leaves every sequence where it was; the next step plans it again.
Requests and aborts may come from any thread: every change to the engine's state takes one
lock, so they land between steps, never inside one (an abort asked for from inside a step --
by a tokenizer or hook -- is applied when the step's work is done). ``EngineCore.build`` makes
every part from plain arguments; the vLLM layer (vllm_api/) builds its ``LLM`` on one.

Where a Ctrl-C lands (the section "interrupts", after the engine core): every operation of the engine core (a step,
queueing requests, an abort, a reset) holds SIGINT and raises ``KeyboardInterrupt`` when the
operation ends, so its bookkeeping runs whole; a step opens ``interrupts_allowed()`` around its
forward and sampling, the one long part, where a Ctrl-C lands at once and stops the step before
its commit. Other exceptions are kept out of the bookkeeping by construction: what may raise (a
hash function, a tokenizer, a hook) runs before anything changes, or is caught for its own
request. Only the main thread receives signals; elsewhere, and where the process runs no
Python SIGINT handler, both are no-ops.

The house has three floors, imports pointing down only (tests/test_layout.py checks it): the
core (the design card's files, core/ and this engine), the fast layer (fast/, plugged in
through core/backend.py), the vLLM layer (vllm_api/). The public face names the vLLM layer's
classes lazily, at first use (``__getattr__`` below): importing the engine loads no vLLM
surface. ``engine.__version__`` is the vLLM release whose API it follows (0.32.0).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from block_manager import BlockManager, KVCachePool
from core.backend import Backend
from core.grammar import GrammarCompiler
from core.kv_disk import DiskTier, TierStats, fingerprint
from core.model_runner import ModelRunner
from core.output_processor import OutputProcessor
from core.outputs import RequestOutput
from core.requests import OutputSink, RequestState
from core.sampler import Sampler
from core.submit import Limits, Request, make_request
from model import CausalLM
from prefix_cache import HashFn, NoPrefixCache, PrefixCache
from scheduler import Scheduler, SchedulerConfig, Sequence  # Sequence: for the face


# ----------------------------------------------------------------------------- the engine core

CANCEL_TRIES = 3  # a clean-up failing again and again is a bug, not an interrupt


class EngineCore:
    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner,
                 output_processor: OutputProcessor, limits: Limits) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.output_processor = output_processor
        self.limits = limits
        self.lock = threading.RLock()  # one step, or one change to the request table, at a time
        self.stream = OutputSink()     # where outputs go when a request names no sink
        self.steps = 0
        self.stepping = False
        self._plan_running = False  # a step's plan is out: its forward runs, its commit is to come
        self._deferred_aborts: list[tuple] = []  # asked for from inside a step
        # Structured outputs: constraints compile at submission, once each (core/grammar.py).
        self.grammars = GrammarCompiler(output_processor.token_texts.tokenizer, limits.vocab_size,
                                        output_processor.eos_token_ids)

    @classmethod
    def build(cls, model: CausalLM, num_blocks: int, *, block_size: int = 16,
              max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
              enable_prefix_caching: bool = True, hash_strategy: str = "incremental",
              backend: Backend | None = None, tokenizer=None, eos_token_ids=(),
              max_model_len: int | None = None, seed: int | None = 0,
              logprobs_mode: str = "raw_logprobs", max_logprobs: int = 20,
              hash_fn: HashFn | None = None,
              prefix_cache_cls: type[PrefixCache] = PrefixCache,
              scheduling_policy: str = "fcfs", logits_processors=(),
              kv_disk_dir: str | None = None, kv_disk_size: float = 4.0,
              kv_disk_write: str = "evict") -> EngineCore:
        """Every part, from the model and plain settings (``backend`` None: the plain path;
        ``hash_fn`` None: the chapter's xxh3_64 chain; ``prefix_cache_cls``: the chapter's
        class, or a subclass with its methods rewritten, as the build-it-yourself track's;
        ``scheduling_policy``: "fcfs" or "priority"; ``logits_processors``: batch processors
        the sampler runs, core/sampler.py; ``kv_disk_dir``: the disk tier under the pool,
        ``kv_disk_size`` GiB, writing evicted blocks or, with ``kv_disk_write="save"``, every
        saved one, core/kv_disk.py)."""
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{scheduling_policy!r}")
        cfg, backend = model.config, backend or Backend(model)
        kv = KVCachePool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                         model.dtype, model.device, zeros=backend.kv_zeros)
        block_manager = BlockManager(num_blocks, block_size)
        cache = (prefix_cache_cls if enable_prefix_caching else NoPrefixCache)(block_manager, hash_strategy)
        if hash_fn is not None:
            cache.hash_fn = hash_fn
        if kv_disk_dir is not None and enable_prefix_caching:
            attach_disk_tier(cache, kv, model, backend, kv_disk_dir, kv_disk_size, kv_disk_write)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                              scheduling_policy), block_manager, cache)
        sampler = Sampler(model.device, seed, sorted(eos_token_ids), logprobs_mode=logprobs_mode,
                          batch_processors=logits_processors)
        limits = Limits(cfg.vocab_size, max_model_len or cfg.max_position_embeddings, block_size,
                        num_blocks, max_logprobs)
        outputs = OutputProcessor(scheduler, tokenizer, set(eos_token_ids), limits.max_model_len)
        return cls(scheduler, ModelRunner(backend, kv, sampler), outputs, limits)

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.scheduler.prefix_cache

    @property
    def model(self) -> CausalLM:
        return self.model_runner.model

    @property
    def tokenizer(self):
        return self.output_processor.token_texts.tokenizer

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One step; the outputs of requests that named no sink (per their ``output_kind``)."""
        with self.operation():
            self._step()
        return self.stream.drain()

    def _step(self) -> None:
        if self.stepping:
            raise RuntimeError("a step cannot run inside another step (a hook of this engine's "
                               "step called generate() or step())")
        self.stepping = True
        try:
            self._abort_abandoned()
            if self.model_runner.weights_changed():  # K/V of the old weights is never served again
                self.reset_prefix_cache(reset_running_requests=True)
                self.model_runner.note_weights()
            plan = self.scheduler.schedule()
            if not plan.chunks:
                if self.scheduler.has_unfinished:
                    raise RuntimeError("scheduler made no progress although requests are pending")
                return
            self._plan_running = True
            with interrupts_allowed():  # the long part: a Ctrl-C here stops the step uncommitted
                result = self.model_runner.run(plan.chunks, self.output_processor.state_of)
            if result is None:  # the weights changed during the forward: the next step re-prefills
                return
            self.output_processor.note_cached_tokens(plan.chunks)
            self.scheduler.commit(plan)
            self.steps += 1
            self.output_processor.process(result)
            if self.prefix_cache.tier.enabled:  # kv_disk_write="save": the commit's blocks, to disk
                self.prefix_cache.tier.flush()
        finally:
            self.stepping = self._plan_running = False
            self.prefix_cache.forget_plan()
            self._apply_deferred_aborts()

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        """The engine's lock (re-entrant: a hook of a step may ask for an abort, applied after
        the step's work), and Ctrl-C held until the operation ends (the section "interrupts" below)."""
        with self.lock, interrupts_held():
            yield

    def run_until_finished(self, sink: OutputSink, num_requests: int) -> None:
        """Step until ``num_requests`` of ``sink``'s requests have finished. Callers in other
        threads step too: whoever holds the lock runs one step for every request."""
        while sink.num_finished < num_requests:
            with self.operation():
                if sink.num_finished < num_requests:
                    self._step()

    # ------------------------------------------------------------------ requests

    def add_requests(self, requests: list[Request], sink: OutputSink | None = None) -> list[RequestState]:
        """Check every request first, then queue them all: one bad request queues nothing.
        Outputs go to ``sink`` (None: to ``step()``'s caller)."""
        with self.operation():
            self._check_ids([r.request_id for r in requests])
            root_hash = self.prefix_cache.root_hash
            states = [make_request(r, self.limits, self.tokenizer, root_hash, sink or self.stream,
                                   self.grammars)
                      for r in requests]  # everything that may raise, before anything changes
            for state in states:
                self.output_processor.add(state)
            return states

    def _check_ids(self, ids: list[str]) -> None:
        for rid in ids:
            if not isinstance(rid, str):
                raise TypeError(f"request_id must be a string, got {type(rid).__name__}")
            if rid in self.output_processor.requests or ids.count(rid) > 1:
                raise ValueError(f"request id {rid!r} is already in use")

    def abort(self, request_id: str, state: RequestState | None = None) -> bool:
        """Cancel a queued or running request (all its sequences), between steps; its blocks
        return (cached ones stay reusable). False if it is unknown or already finished. With
        ``state``, only if the id still names that very request (a caller cleaning up its own
        requests never touches another's that reused the id)."""
        with self.operation():
            live = self.output_processor.is_live(str(request_id), state)
            if live and self.stepping:  # asked for from inside a step: applied after its work
                self._deferred_aborts.append((str(request_id), state))
                return True
            return live and self.output_processor.abort(str(request_id), state)

    def cancel(self, sink: OutputSink | None = None) -> None:
        """Abort every live request whose outputs go to ``sink`` (None: every request), each
        on its own: one that raises does not stop the others (the first error is raised at
        the end). A ``generate()`` call cleans up by its sink: only its own requests. A clean-up
        cut short (a second Ctrl-C) is run again."""
        first = None
        for _ in range(CANCEL_TRIES):
            try:
                self._cancel_once(sink)
                break
            except BaseException as exc:  # noqa: BLE001 -- raised below, once the clean-up is done
                first = first or exc
        if first is not None:
            raise first

    def _cancel_once(self, sink: OutputSink | None) -> None:
        errors = []
        with self.operation():  # a Ctrl-C meanwhile lands once every request is aborted
            mine = [s for s in self.output_processor.requests.values() if sink in (None, s.sink)]
            for state in mine:
                try:
                    self.abort(state.request_id, state)
                except Exception as exc:  # noqa: BLE001 -- re-raised below, after the rest
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _abort_abandoned(self) -> None:
        """Requests whose caller is gone (a generate() whose clean-up a second interrupt cut
        short): nobody waits for them, so they run no further."""
        for state in [s for s in self.output_processor.requests.values() if s.sink.abandoned]:
            self.output_processor.abort(state.request_id, state)

    def _apply_deferred_aborts(self) -> None:
        pending, self._deferred_aborts = self._deferred_aborts, []
        for request_id, state in pending:
            self.output_processor.abort(request_id, state)

    @property
    def has_unfinished(self) -> bool:
        """True while a request runs or waits, or ``step()``'s caller has outputs to collect."""
        with self.lock:
            return self.scheduler.has_unfinished or bool(self.stream.outputs)

    @property
    def num_unfinished(self) -> int:
        return len(self.output_processor.requests)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached-and-free blocks; True if the cache is now empty (as vLLM's). With
        ``reset_running_requests``, running sequences are preempted first (they are re-prefilled).
        What the backend derived from the weights is derived again: after weights written where
        no version counter sees it (``param.data``), this is the call that makes them seen. From a
        hook while a step's forward runs, nothing is reset (False): that step's plan holds blocks."""
        with self.operation():
            if self._plan_running:
                return False
            self.model_runner.backend.rederive()
            if self.prefix_cache.tier.enabled:  # the disk tier: the weights' namespace, again
                self.prefix_cache.tier.new_weights()
            if reset_running_requests:
                for seq in list(reversed(self.scheduler.running)):
                    self.scheduler.preempt(seq)
            return self.prefix_cache.reset()

    def shutdown(self) -> None:
        """Abort every request still in the engine."""
        self.cancel()

    def stats(self) -> dict:
        """Cumulative counters over this engine's life (prefix-cache figures in tokens)."""
        with self.lock:
            sched, bm, pc = self.scheduler.stats, self.block_manager, self.prefix_cache
            return dict(
                generation_tokens=self.output_processor.generation_tokens,
                prompt_tokens=self.output_processor.prompt_tokens,
                steps=self.steps,
                hash_computations=pc.hash_computations,
                prompt_tokens_computed=sched.prompt_tokens_computed,
                prompt_tokens_cached=sched.prompt_tokens_cached,
                prefix_cache_queries=sched.prefix_cache_queries,
                prefix_cache_hits=sched.prefix_cache_hits,
                prefix_cache_hit_rate=sched.prefix_cache_hits / max(sched.prefix_cache_queries, 1),
                preemptions=sched.preemptions,
                evictions=pc.num_evictions,
                num_blocks=bm.num_blocks,
                blocks_in_use=bm.num_blocks_in_use,
                blocks_cached=pc.num_cached_blocks,
                free_blocks=bm.num_free_blocks,
                **(pc.tier.stats if pc.tier.enabled else TierStats()).as_dict(),
            )


def attach_disk_tier(cache: PrefixCache, kv: KVCachePool, model: CausalLM, backend: Backend,
                     directory: str, size_gib: float, write: str) -> DiskTier:
    """The disk tier under ``cache``'s pool, its namespace fingerprinting what K/V depends on."""
    def name() -> str:
        return fingerprint(model, backend.name, kv.block_size, cache.hash_fn)
    tier = DiskTier(directory, int(size_gib * 2**30), kv, name, write)
    tier.attach(cache)
    return tier


# ----------------------------------------------------------------------------- interrupts


class _Held:
    """The main thread's state: how deep the held sections go, the handler they replaced, and
    the Ctrl-C noted meanwhile."""

    depth = 0
    previous = None
    arrived: list = []


def _note(signum, frame) -> None:
    _Held.arrived.append((signum, frame))


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    if not _main() or (_Held.depth == 0 and not callable(signal.getsignal(signal.SIGINT))):
        yield
        return
    if _Held.depth == 0:
        _Held.previous, _Held.arrived = signal.getsignal(signal.SIGINT), []
        signal.signal(signal.SIGINT, _note)
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        if _Held.depth == 0:
            signal.signal(signal.SIGINT, _Held.previous)
            _deliver()


@contextlib.contextmanager
def interrupts_allowed() -> Iterator[None]:
    """Inside a held section: a Ctrl-C lands here at once (and one noted before, as it opens)."""
    if not _main() or _Held.depth == 0:
        yield
        return
    signal.signal(signal.SIGINT, _Held.previous)
    try:
        _deliver()
        yield
    finally:
        signal.signal(signal.SIGINT, _note)


def _deliver() -> None:
    if _Held.arrived:
        first, _Held.arrived = _Held.arrived[0], []
        _Held.previous(*first)  # Python's own handler raises KeyboardInterrupt here


# ----------------------------------------------------------------------------- the public face
# vLLM's names (LLM, LLMEngine, SamplingParams, ... : vllm_api/public.py), resolved when a script
# first asks for one, so the engine above never loads the vLLM layer it does not use.

def __getattr__(name: str):
    if name.startswith("__") and name not in ("__all__", "__version__", "__version_tuple__"):
        # the import system's probes (__path__, __spec__, ...): not the face's
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    from vllm_api import llm, llm_engine, public
    face = {"LLM": llm.LLM, "LLMEngine": llm_engine.LLMEngine}
    if name == "__all__":
        return ["EngineCore", "Backend", "Sequence", *face, *public.__all__]
    if name in face:
        return face[name]
    try:
        return getattr(public, name)
    except AttributeError:
        raise AttributeError(f"module 'engine' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
