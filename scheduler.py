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
recently admitted running sequence.

Nothing is lost when something fails: the scheduler owns its queues and counters, each
``Sequence`` its fields, and ``snapshot()`` / ``restore()`` save and put back both; the engine
core calls them around every step and every request change (core/atomic.py). So a step that
raises anywhere -- in the forward, in a hook such as ``hash_fn``, on a ``KeyboardInterrupt``
between two lines of the bookkeeping -- leaves every queue, block table and block exactly as
before it, and the same step is simply scheduled again.
"""
from __future__ import annotations

import copy
import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from block_manager import Block, BlockManager

# Token ids as fixed-width little-endian bytes: what is hashed, stable across processes.
TOKEN_DTYPE = np.dtype("<i8")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, its KV blocks and its chain of block hashes."""

    _next_id = itertools.count()

    def __init__(self, token_ids, max_tokens: int = 16, *, request_id: str | None = None,
                 cache_salt: str | None = None, root_hash: int = 0,
                 reads_prefix_cache: bool = True) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise TypeError(f"max_tokens must be an integer >= 1, got {max_tokens!r} (a Sequence "
                            f"keeps no sampling parameters: pass max_tokens=params.max_tokens)")
        self.request_id = request_id if request_id is not None else str(next(Sequence._next_id))
        self.cache_salt = cache_salt
        # The chain's seed, before the first block: 0, or the cache_salt's hash (see prefix_cache.py).
        self._root_hash = root_hash
        self.max_tokens = int(max_tokens)
        self.reads_prefix_cache = reads_prefix_cache  # False: compute the whole prompt (prompt logprobs)
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

    def snapshot(self) -> tuple:
        """Every field that changes while it runs (the token buffer only grows, so its length
        is enough), to ``restore`` after a failure."""
        return (self.num_tokens, self.status, list(self.block_table), self.num_computed_tokens,
                list(self._block_hashes), self.finish_reason)

    def restore(self, saved: tuple) -> None:
        (self.num_tokens, self.status, block_table, self.num_computed_tokens, hashes,
         self.finish_reason) = saved
        self.block_table = list(block_table)
        self._block_hashes[:] = hashes  # in place: a lookup's match may hold the list

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


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
        self.waiting.append(seq)

    def snapshot(self) -> tuple:
        """The queues, the counters and every queued sequence's fields."""
        seqs = [*self.waiting, *self.running]
        return (list(self.waiting), list(self.running), copy.copy(self.stats),
                [(seq, seq.snapshot()) for seq in seqs])

    def restore(self, saved: tuple) -> None:
        waiting, running, stats, seqs = saved
        self.waiting.clear()
        self.waiting.extend(waiting)
        self.running[:] = running
        self.stats.__dict__.update(vars(stats))
        for seq, fields in seqs:
            seq.restore(fields)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks = self._schedule_decodes(budget)
        budget -= len(chunks)
        for seq in self.running:
            if budget > 0 and seq.num_uncomputed_tokens > 1:
                chunks.append(ScheduledChunk(seq, min(seq.num_uncomputed_tokens, budget)))
                budget -= chunks[-1].num_tokens
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            chunks.append(ScheduledChunk(seq, min(seq.num_uncomputed_tokens, budget)))
            budget -= chunks[-1].num_tokens
        return chunks

    def _schedule_decodes(self, budget: int) -> list[ScheduledChunk]:
        chunks = []
        i = 0
        while i < len(self.running) and len(chunks) < budget:
            seq = self.running[i]
            if seq.num_uncomputed_tokens == 1:
                if not self._reserve_slot(seq):
                    break  # seq itself was preempted; it was the last running one
                chunks.append(ScheduledChunk(seq, 1))
            i += 1
        return chunks

    def _reserve_slot(self, seq: Sequence) -> bool:
        """Make sure the block table covers the next token, preempting from the tail if needed."""
        bm = self.block_manager
        while len(seq.block_table) * self.block_size < seq.num_tokens:
            if bm.num_free_blocks > 0:
                seq.block_table.append(self._allocate().block_id)
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Take cached blocks and allocate the rest for all of ``seq``'s tokens, or nothing."""
        match = self.prefix_cache.lookup(seq)
        if match.next_in_flight:
            return False  # wait a step: the block is being written, then it is a hit
        num_new = -(-seq.num_tokens // self.block_size) - len(match.blocks)
        if not self.block_manager.can_allocate(num_new, match.blocks):
            return False
        for block in match.blocks:
            self.block_manager.share(block)
        new = [self._allocate() for _ in range(num_new)]
        seq.block_table = [b.block_id for b in match.blocks + new]
        seq.num_computed_tokens = match.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.prefix_cache.mark_in_flight(seq, match)
        self._count_admission(seq, match)
        return True

    def _allocate(self) -> Block:
        """A fresh block; reusing a cached-and-free one evicts it from the prefix cache."""
        return self.block_manager.allocate(self.prefix_cache.evict)

    def _count_admission(self, seq: Sequence, match) -> None:
        self.stats.prefix_cache_queries += match.queried
        if match.queried:
            self.stats.prefix_cache_hits += seq.num_computed_tokens
        self.stats.prompt_tokens_cached += min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """The step's forward succeeded: advance each sequence and cache the blocks it filled."""
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            seq.num_computed_tokens = end = start + chunk.num_tokens
            self.stats.prompt_tokens_computed += max(0, min(end, seq.num_prompt_tokens) - start)
            for index, twin in self.prefix_cache.cache_blocks(seq, start, end):
                self._switch_to_twin(seq, index, twin)

    def _switch_to_twin(self, seq: Sequence, index: int, twin: Block) -> None:
        """An identical block was cached first (same prompt computed in the same step): share it
        and free ``seq``'s copy, so later blocks chain from one parent."""
        self.block_manager.share(twin)
        self.block_manager.free([seq.block_table[index]])
        seq.block_table[index] = twin.block_id

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (cached ones stay reusable) and queue it first, to be prefilled
        again (a re-prefill, shortened by its lookup; not ``hash_strategy="recompute"``)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
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
        self.block_manager.free(seq.block_table)
        self.prefix_cache.release(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
