"""Requests and their scheduling in step14_5: ``Sequence`` and the ``Scheduler``.

A ``Sequence`` carries the chapter's state: ``_block_hashes`` (one chained hash per full
block of its tokens, in order) and ``_prev_hash`` (the chain's last value, derived; before
the first block it is ``_root_hash``, the chain's seed: 0, or the hash of the request's
``cache_salt``), so the prefix cache never rebuilds the chain for a request it has seen. Every field has one writer:

=================================================  ===========================================
field                                              written by
=================================================  ===========================================
request_id, cache_salt, _root_hash,                 the constructor (the engine's intake)
num_prompt_tokens, max_tokens, reads_prefix_cache
tokens, num_tokens (``append_token``)               the output processor, after sampling
status, block_table, num_computed_tokens,           the scheduler (admit, commit, preempt,
finish_reason                                       finish, abort)
_block_hashes                                       the prefix cache (``_precompute_block_hashes``)
=================================================  ===========================================

How to sample, text, logprobs and timings are the engine's record of the request
(core/requests.py); a ``Sequence`` keeps only what scheduling and hashing need.

Each step the scheduler first gives every running sequence in decode its one token, then
fills what is left of the token budget with prefill chunks (continuing ones first, then new
admissions), so long prompts are split across steps and share forwards with decode tokens.
Admission takes the cached prefix the prefix cache finds, or waits a step when another
sequence is computing the block it needs next. When blocks run out it preempts the most
recently admitted running sequence. With ``policy="priority"`` (vLLM's scheduling_policy) the
waiting queue is kept in (priority, arrival) order -- lower priority values first -- and the
sequence preempted is the running one last in that order; hashing is the same either way.

A step is a plan, then a commit. ``schedule()`` plans: which tokens run, which waiting
sequences are admitted with which cached and fresh blocks (``Reservation``), and it changes
nothing of the sequences, the queues or the pool, except what the plan needs done before the
forward writes: a preemption (its blocks are reused) and an eviction (a cached block whose K/V
the forward will overwrite leaves the map now, so no failure can bring it back). ``commit()``
applies the plan once the forward and sampling succeeded. A step that fails before its commit
leaves every sequence where it was, and the same step is simply planned again.
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from block_manager import Block, BlockManager, Reservation

# Token ids as fixed-width little-endian bytes: what is hashed, stable across processes.
TOKEN_DTYPE = np.dtype("<i8")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, its KV blocks and its chain of block hashes."""

    _next_id, _arrivals = itertools.count(), itertools.count()  # ids; arrival order (priority)

    def __init__(self, token_ids, max_tokens: int = 16, *, request_id: str | None = None,
                 cache_salt: str | None = None, root_hash: int = 0,
                 reads_prefix_cache: bool = True, priority: int = 0) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise TypeError(f"max_tokens must be an integer >= 1, got {max_tokens!r} (a Sequence "
                            f"keeps no sampling parameters: pass max_tokens=params.max_tokens)")
        self.request_id = request_id if request_id is not None else str(next(Sequence._next_id))
        self.cache_salt = cache_salt
        # The chain's seed, before the first block: 0, or the cache_salt's hash (see prefix_cache.py).
        self._root_hash = root_hash
        self.max_tokens = int(max_tokens)
        self.reads_prefix_cache = reads_prefix_cache  # False: compute the whole prompt (prompt logprobs)
        self.priority, self.arrival = int(priority), next(Sequence._arrivals)  # policy "priority"
        prompt = np.asarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)
        if prompt.size == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        # One preallocated buffer: appending a token never copies, hashing slices it as bytes.
        self.tokens = np.empty(prompt.size + self.max_tokens, dtype=TOKEN_DTYPE)
        self.tokens[:prompt.size] = prompt
        self.num_prompt_tokens = self.num_tokens = int(prompt.size)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self._block_hashes: list[int] = []
        self.finish_reason: str | None = None

    @property
    def _prev_hash(self) -> int:
        """The chain's last value (derived, so it can never drift from ``_block_hashes``)."""
        return self._block_hashes[-1] if self._block_hashes else self._root_hash

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:self.num_tokens].tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.tokens[self.num_tokens] = token_id
        self.num_tokens += 1

    def token_view(self) -> memoryview:
        """The id buffer as a zero-copy view: hashing a block copies only that block's ids."""
        return memoryview(self.tokens)

    def block_bytes(self, index: int, block_size: int) -> bytes:
        """Token ids of block ``index`` as fixed-width bytes (what is hashed and verified)."""
        return self.tokens[index * block_size:(index + 1) * block_size].tobytes()

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str = "fcfs"  # or "priority": see the module's text


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of ``seq``, run in one step over ``block_table``
    (the sequence's own, or the one its admission will give it)."""

    seq: Sequence
    num_tokens: int
    start: int
    block_table: list[int]

    @property
    def completes_sequence(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits are sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class Admission:
    """A waiting sequence the plan admits: its cached prefix and the fresh blocks it takes."""

    seq: Sequence
    match: "PrefixMatch"
    fresh: list[Block]


@dataclass
class StepPlan:
    """One step, decided: the chunks to run, and what the commit applies besides advancing
    them. Iterating it gives the chunks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    slots: list[tuple[Sequence, Block]] = field(default_factory=list)  # a decode token's new block

    def __iter__(self):
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, counted on admission (as vLLM)
    prefix_cache_hits: int = 0     # tokens served from cache
    prompt_tokens_cached: int = 0
    prompt_tokens_computed: int = 0


@dataclass
class Scheduler:
    config: SchedulerConfig
    block_manager: BlockManager
    prefix_cache: "PrefixCache"  # prefix_cache.py (which imports this module); NoPrefixCache: off
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order: the tail is preempted first
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self._queue(seq)

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Wait in arrival order (a preempted sequence first), or under the "priority" policy
        at its (priority, arrival) place, as vLLM orders its queue."""
        if self.config.policy != "priority":
            return self.waiting.appendleft(seq) if front else self.waiting.append(seq)
        at = next((i for i, w in enumerate(self.waiting)
                   if (w.priority, w.arrival) > (seq.priority, seq.arrival)), len(self.waiting))
        self.waiting.insert(at, seq)

    # ------------------------------------------------------------------ the plan

    def schedule(self) -> StepPlan:
        """Decode tokens first, then continuing prefill chunks, then admissions, within the
        token budget. Changes nothing but preemptions and evictions (see the module's text)."""
        plan, budget = StepPlan(), self.config.max_num_batched_tokens
        reservation = Reservation(self.block_manager)
        self.prefix_cache.forget_plan()  # a plan dropped before (its step failed) counts no more
        self._plan_decodes(plan, reservation, budget)
        budget -= len(plan.chunks)
        for seq in self.running:
            if budget > 0 and seq.num_uncomputed_tokens > 1:
                n = min(seq.num_uncomputed_tokens, budget)
                plan.chunks.append(ScheduledChunk(seq, n, seq.num_computed_tokens, seq.block_table))
                budget -= n
        seats = self.config.max_num_seqs - len(self.running)
        while budget > 0 and len(plan.admissions) < min(seats, len(self.waiting)):
            seq = self.waiting[len(plan.admissions)]  # in order: the first that must wait stops the rest
            admission = self._plan_admission(seq, reservation)
            if admission is None:
                break
            start = admission.match.num_cached_tokens
            n = min(seq.num_tokens - start, budget)
            table = [b.block_id for b in admission.match.blocks + admission.fresh]
            plan.admissions.append(admission)
            plan.chunks.append(ScheduledChunk(seq, n, start, table))
            budget -= n
        return plan

    def _plan_decodes(self, plan: StepPlan, reservation: Reservation, budget: int) -> None:
        for seq in list(self.running):
            if len(plan.chunks) >= budget:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted while an earlier one was planned
            if seq.num_uncomputed_tokens == 1:
                table = self._plan_slot(seq, plan, reservation)
                if table is not None:  # None: seq itself was preempted
                    plan.chunks.append(ScheduledChunk(seq, 1, seq.num_computed_tokens, table))

    def _plan_slot(self, seq: Sequence, plan: StepPlan, reservation: Reservation) -> list[int] | None:
        """The block table that covers the next token: the sequence's own, or its own plus a
        reserved block, preempting from the tail when none is free (None: seq was preempted)."""
        if len(seq.block_table) * self.block_size >= seq.num_tokens:
            return seq.block_table
        while reservation.num_free == 0:
            victim = (max(self.running, key=lambda s: (s.priority, s.arrival))
                      if self.config.policy == "priority" else self.running[-1])
            self._unplan(victim, plan, reservation)
            self.preempt(victim)
            reservation.rewind()
            if victim is seq:
                return None
        block = self._reserve_fresh(reservation, seq)
        plan.slots.append((seq, block))
        return seq.block_table + [block.block_id]

    @staticmethod
    def _unplan(seq: Sequence, plan: StepPlan, reservation: Reservation) -> None:
        """Drop a planned decode of ``seq`` and its block (a priority victim may be planned)."""
        plan.chunks = [c for c in plan.chunks if c.seq is not seq]
        reservation.held -= {block.block_id for owner, block in plan.slots if owner is seq}
        plan.slots = [(owner, block) for owner, block in plan.slots if owner is not seq]

    def _plan_admission(self, seq: Sequence, reservation: Reservation) -> Admission | None:
        """Cached blocks and fresh ones for all of ``seq``'s tokens, or None (wait)."""
        match = self.prefix_cache.lookup(seq)
        if match.next_in_flight:
            return None  # wait a step: the block is being written, then it is a hit
        num_new = -(-seq.num_tokens // self.block_size) - len(match.blocks)
        if not reservation.can_take(num_new, match.blocks):
            return None
        for block in match.blocks:
            reservation.share(block)
        fresh = [self._reserve_fresh(reservation, seq) for _ in range(num_new)]
        self.prefix_cache.load(seq, match, fresh)  # blocks read from the disk tier, if any
        self.prefix_cache.plan_in_flight(seq, match)
        return Admission(seq, match, fresh)

    def _reserve_fresh(self, reservation: Reservation, seq: Sequence) -> Block:
        """A fresh block for ``seq`` in the plan. One still cached is evicted now: this step's
        forward will overwrite its K/V, so its entry must be gone whether or not the step commits."""
        block = reservation.next_fresh()
        if block.block_hash is not None:
            self.prefix_cache.evict(block, seq)
        return block

    # ------------------------------------------------------------------ the commit

    def commit(self, plan: StepPlan) -> None:
        """The step's forward succeeded: admit, take the reserved blocks, advance each sequence
        and cache the blocks it filled. The hashes the saves need are computed first, so
        nothing below runs a hash function (a swapped ``hash_fn`` may raise)."""
        for chunk in plan.chunks:
            self.prefix_cache.prepare_saves(chunk.seq, chunk.start, chunk.start + chunk.num_tokens,
                                            chunk.block_table)
        for admission in plan.admissions:
            self._admit(admission)
            self._register_loaded(admission)
        for seq, block in plan.slots:
            seq.block_table.append(self.block_manager.take(block).block_id)
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.start
            seq.num_computed_tokens = end = start + chunk.num_tokens
            self.stats.prompt_tokens_computed += max(0, min(end, seq.num_prompt_tokens) - start)
            for index, twin in self.prefix_cache.cache_blocks(seq, start, end):
                self._switch_to_twin(seq, index, twin)
        self.prefix_cache.forget_plan()

    def _admit(self, admission: Admission) -> None:
        seq, match = admission.seq, admission.match
        if self.waiting[0] is not seq:
            raise RuntimeError(f"plan out of date: {seq.request_id} is not first in the waiting queue")
        self.waiting.popleft()
        for block in match.blocks:
            self.block_manager.retain(block)
        fresh = [self.block_manager.take(block) for block in admission.fresh]
        seq.block_table = [b.block_id for b in match.blocks + fresh]
        seq.num_computed_tokens = match.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.prefix_cache.mark_in_flight(seq, match)
        self._count_admission(seq, match)

    def _register_loaded(self, admission: Admission) -> None:
        """Blocks the plan loaded from the disk tier are cached now, as if computed: the
        commit is when a load becomes visible (a failed step never registers them)."""
        seq, match = admission.seq, admission.match
        if match.loaded:
            start = len(match.blocks) * self.block_size
            for index, twin in self.prefix_cache.cache_blocks(seq, start, match.num_cached_tokens):
                self._switch_to_twin(seq, index, twin)

    def _count_admission(self, seq: Sequence, match) -> None:
        self.stats.prefix_cache_queries += match.queried
        if match.queried:
            self.stats.prefix_cache_hits += seq.num_computed_tokens
        self.stats.prompt_tokens_cached += min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _switch_to_twin(self, seq: Sequence, index: int, twin: Block) -> None:
        """An identical block was cached first (same prompt computed in the same step): share it
        and free ``seq``'s copy, so later blocks chain from one parent."""
        self.block_manager.retain(twin)
        self.block_manager.release([seq.block_table[index]])
        seq.block_table[index] = twin.block_id

    # ------------------------------------------------------------------ leaving the running set

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (cached ones stay reusable) and queue it first, to be prefilled
        again (a re-prefill, shortened by its lookup; not ``hash_strategy="recompute"``)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self._queue(seq, front=True)
        self.stats.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"

    def _release(self, seq: Sequence) -> None:
        self.block_manager.release(seq.block_table)
        self.prefix_cache.unmark_in_flight(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
