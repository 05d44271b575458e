"""Requests and their scheduling in step14_5: ``Sequence``, ``SamplingParams`` and the ``Scheduler``.

A ``Sequence`` carries the chapter's state: ``_block_hashes`` (one chained hash per full
block of its tokens, in order) and ``_prev_hash`` (the chain's last value), so the engine
never rebuilds the chain for a request it has seen.

Each step the scheduler first gives every running sequence in decode its one token, then
fills what is left of the token budget with prefill chunks (continuing ones first, then new
admissions), so long prompts are split across steps and share forwards with decode tokens.
When blocks run out it preempts the most recently admitted running sequence.
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

from block_manager import BlockManager
from sampling_params import SamplingParams

# Token ids as fixed-width little-endian bytes: what is hashed, stable across processes.
TOKEN_DTYPE = np.dtype("<i8")
TOKEN_BYTES = TOKEN_DTYPE.itemsize


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, its KV blocks and its chain of block hashes."""

    _next_id = itertools.count()

    def __init__(self, token_ids, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> None:
        self.sampling_params = sampling_params or SamplingParams()
        self.prompt_text: str | None = None  # set when the request came as a string
        self.request_id = request_id if request_id is not None else str(next(Sequence._next_id))
        prompt = np.asarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)
        if prompt.size == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        # One preallocated buffer: appending a token never copies, hashing slices it as bytes.
        self.tokens = np.empty(prompt.size + self.sampling_params.max_tokens, dtype=TOKEN_DTYPE)
        self.tokens[:prompt.size] = prompt
        self.num_prompt_tokens = self.num_tokens = int(prompt.size)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self._block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if self.sampling_params.logprobs is not None else None
        self.arrival_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def root_hash(self) -> int:
        """The chain's starting value: 0, or the cache salt's hash so salts never share blocks."""
        salt = self.sampling_params.cache_salt
        return 0 if salt is None else xxhash.xxh3_64_intdigest(salt.encode())

    @property
    def _prev_hash(self) -> int:
        """The chain's last value (derived, so it can never drift from ``_block_hashes``)."""
        return self._block_hashes[-1] if self._block_hashes else self.root_hash

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens[:self.num_prompt_tokens].tolist()

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

    def token_bytes(self) -> bytes:
        """All token ids as bytes, copied once per lookup so blocks are checked by slicing."""
        return self.tokens[:self.num_tokens].tobytes()

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
    block_size: int
    enable_prefix_caching: bool


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


# (cached block ids, cached token count, last hash) -- the engine's _lookup_prefix_cache
PrefixLookup = Callable[[Sequence], tuple[list[int], int, int]]
# (seq, number of cached blocks) -> is another running sequence computing the next one?
InFlightCheck = Callable[[Sequence, int], bool]


@dataclass
class Scheduler:
    config: SchedulerConfig
    block_manager: BlockManager
    lookup_prefix_cache: PrefixLookup
    prefix_in_flight: InFlightCheck
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order: the tail is preempted first
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        while len(seq.block_table) * self.config.block_size < seq.num_tokens:
            if bm.num_free_blocks > 0:
                seq.block_table.append(bm.allocate().block_id)
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Take cached blocks and allocate the rest for all of ``seq``'s tokens, or nothing."""
        bm = self.block_manager
        cached_ids, cached_len = [], 0
        if self.config.enable_prefix_caching:
            cached_ids, cached_len, _ = self.lookup_prefix_cache(seq)
            if self.prefix_in_flight(seq, len(cached_ids)):
                return False  # wait a step: the shared block is being written, then it is a hit
        cached = [bm.blocks[i] for i in cached_ids]
        num_new = -(-seq.num_tokens // self.config.block_size) - len(cached)
        if not bm.can_allocate(num_new, cached):
            return False
        for block in cached:
            bm.share(block)
        seq.block_table = cached_ids + [bm.allocate().block_id for _ in range(num_new)]
        seq.num_computed_tokens = cached_len
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._count_admission(seq, cached_len)
        return True

    def _count_admission(self, seq: Sequence, cached_len: int) -> None:
        if self.config.enable_prefix_caching:
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += cached_len
        self.stats.prompt_tokens_cached += min(cached_len, seq.num_prompt_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (cached ones stay reusable) and queue it first for recompute."""
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
        seq.block_table = []
        seq.num_computed_tokens = 0
