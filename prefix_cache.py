"""The chapter, step14_5, in one place: the paged prefix cache on an incremental hash chain.

A full block of ``block_size`` tokens is named by a chain hash: xxhash of the block's token
ids, seeded with the previous block's hash, so one hash names the whole prefix up to it.
The map ``_prefix_cache`` (hash -> cached block) lets a new request skip the prefill of any
prefix another request already computed. The chapter's point: each ``Sequence`` keeps its
own chain (``_block_hashes``, ``_prev_hash``), so a sequence's blocks are hashed once, and
lookups and saves reuse those hashes instead of rebuilding the chain.

Read top to bottom; the chapter's names are kept verbatim (hence their leading underscores):

1. ``_chain_hash``               one block's hash, seeded with its parent's
2. what the chapter changes, both columns side by side: ``_chain_for_lookup`` and
   ``_hash_for_save`` (the only places that ask which strategy runs), then
   ``_precompute_block_hashes`` (extend a sequence's chain, each block once) and the
   "before"'s ``_rebuild_chain`` / ``_rehash_block``
3. ``_lookup_prefix_cache``      the longest verified cached prefix, and the in-flight rule
4. ``mark_in_flight``            blocks an admitted sequence will compute, so others wait for them
5. ``_do_prefill_step`` / ``_save_prefix_cache``  register each block a step filled
6. ``evict`` / ``reset``         what leaves the map
7. ``_why_stopped``              why a lookup stopped where it did (``CacheMiss``)

``hash_strategy="recompute"`` is the chapter's "before" column (its Paged Prefix Cache): the chain is
rebuilt from scratch at every lookup and each block is hashed again when saved, chained
from its parent block's hash. Everything else is identical, so the two strategies make the
same admissions, waits, hits and evictions and produce the same tokens; only
``hash_computations`` differs.

The scheduler calls the public seam -- ``lookup`` (the chapter's ``_lookup_prefix_cache``) and
``mark_in_flight`` when it admits a sequence, ``cache_blocks`` (``_do_prefill_step``) after each
step, ``release`` when a sequence leaves, and passes ``evict`` to the block manager when it
reuses a free block that still carries a hash. ``with cache.recording() as events:`` records
what happens to each block (``ChainEvent``); ``subscribe`` hands every event to a function.

The cache owns its maps (hash -> block, the in-flight marks) and its counters, and writes each
``Sequence``'s chain. A step plans, then commits (scheduler.py): while it plans, the blocks its
admissions will compute are marked ``plan_in_flight`` (seen by the next lookups of the same
plan) and become in flight at the commit; before the commit changes anything,
``prepare_saves`` computes the hashes the saves need, so a commit never runs a hash function.
A chain already on a ``Sequence`` stays there whatever becomes of the step: it is a function of
tokens that never change. ``NoPrefixCache`` at the end is the cache with prefix caching off: it
never hits and never saves, so the scheduler never asks whether there is one.
"""
from __future__ import annotations

import contextlib
import enum
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

import xxhash

from block_manager import Block, BlockManager
from scheduler import Sequence

HASH_STRATEGIES = ("incremental", "recompute")
HashFn = Callable[[bytes, int], int]  # (block bytes, seed) -> 64-bit hash


class HashSource(enum.Enum):
    """Where a block's hash came from (shown by ``run.py --chain``)."""

    PRECOMPUTED = "precomputed at lookup"
    REUSED = "reused at save"
    DECODE = "computed at decode"
    SAVE = "computed at save"             # a prompt no lookup hashed (it reads no cache)
    RECOMPUTED = "recomputed at lookup"   # the "before": the whole chain, at every lookup
    RECOMPUTED_AT_SAVE = "recomputed at save"


@dataclass
class ChainEvent:
    """One thing that happened to one block of one request (see ``PrefixCache.recording``)."""

    kind: str              # "hash" (one hash call), "reuse" (a hash read off the Sequence, no
                           # call), "hit", "miss" (where a lookup stopped: one per lookup, with
                           # its reason), "wait", "save", "twin", "evict"; reset():
                           # "forget" (a cached-and-free block), then "clear" if none is left
    request_id: str | None  # None for "evict", "forget", "clear" (no request's block)
    index: int | None       # block index in the sequence; None for those three
    block_hash: int | None = None
    parent_hash: int | None = None
    block_id: int | None = None
    source: HashSource | None = None
    reason: CacheMiss | None = None  # "miss": why the lookup stopped at this block


class MissReason(enum.Enum):
    """Why a lookup stopped where it did: the block it stopped at is not served, because ..."""

    NEVER_SAVED = "no entry for its hash: never saved"
    EVICTED = "no entry for its hash: evicted"
    COLLISION = "the entry under its hash holds other tokens (a hash collision)"
    OTHER_PARENT = "the entry under its hash follows another parent block"
    OTHER_SALT = "a different cache_salt"
    PARTIAL_BLOCK = "the tail is a partial block"
    LAST_TOKEN = "the last token is never served from cache"
    IN_FLIGHT = "the next block is in flight"
    NOT_READ = "the request reads no cache"
    CACHING_OFF = "prefix caching is off"


class CacheMiss(str):
    """Why one lookup stopped: a sentence (it is the str it holds, so it prints as one), and its
    parts: ``reason``, ``block`` (the block index it stopped at), ``position`` (a collision's
    first differing token) and ``waited`` (earlier lookups of the same sequence that waited for
    an in-flight block). A request's output carries its first admission's (``cache_miss_reason``)."""

    reason: MissReason
    block: int | None
    position: int | None
    waited: int

    def __new__(cls, reason: MissReason, block: int | None, text: str, position: int | None = None,
                waited: int = 0):
        obj = super().__new__(cls, text)
        obj.reason, obj.block, obj.position, obj.waited = reason, block, position, waited
        return obj

    def __reduce__(self):
        return CacheMiss, (self.reason, self.block, str(self), self.position, self.waited)


CACHING_OFF = CacheMiss(MissReason.CACHING_OFF, None, MissReason.CACHING_OFF.value)
EVICTIONS_REMEMBERED = 4096  # eviction records kept for miss reasons (oldest dropped first)


@dataclass
class PrefixMatch:
    """What a lookup found for one sequence."""

    blocks: list[Block]     # cached blocks serving its prefix, in order
    num_cached_tokens: int
    chain: list[int]        # hash of every full block the sequence has (to mark what it computes)
    next_in_flight: bool    # another running sequence is computing the block it needs next
    queried: int = 0        # tokens looked up (0 when the cache was not read)
    loaded: list = field(default_factory=list)  # blocks after ``blocks`` read from the disk tier

    @property
    def num_served_blocks(self) -> int:
        return len(self.blocks) + len(self.loaded)

    @classmethod
    def nothing(cls, queried: int = 0) -> PrefixMatch:
        """No cached prefix, nothing to mark."""
        return cls([], 0, [], False, queried)


class PrefixCache:
    enabled = True  # False for NoPrefixCache
    def __init__(self, block_manager: BlockManager, hash_strategy: str = "incremental",
                 hash_fn: HashFn = xxhash.xxh3_64_intdigest) -> None:
        if hash_strategy not in HASH_STRATEGIES:
            raise ValueError(f"hash_strategy must be one of {HASH_STRATEGIES}, got {hash_strategy!r}")
        self.block_manager = block_manager
        self.hash_strategy = hash_strategy
        self.hash_fn = hash_fn  # swappable: tests plug in a weak hash to force collisions
        self._prefix_cache: dict[int, Block] = {}      # hash -> cached block
        self.tier = NoTier()  # the tier under the pool: the engine puts core/kv_disk.py's there
        self._in_flight: dict[int, Sequence] = {}      # hash -> sequence computing it
        self._planned: dict[int, Sequence] = {}        # the same, for this step's admissions
        self._ahead: dict[tuple[bytes, int], int] = {}  # hash_fn results a commit will ask for
        self._computing: dict[Sequence, list[int]] = {}  # sequence -> hashes it marked (never edited in place)
        self.hash_computations = 0
        self.num_evictions = 0
        self._listeners: list[Callable[[ChainEvent], None]] = []
        # Only for telling why a lookup stopped (section 7); nothing above reads them.
        self._evicted: OrderedDict[int, str] = OrderedDict()  # hash -> when and for whom it left
        self._evictions_forgotten = False                      # older records were dropped
        self._stops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> its last CacheMiss
        self._waits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> (waits, first)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    # ------------------------------------------------------------------ the public seam
    # What the scheduler and the teaching tools call (vLLM-like names); each is one of the
    # chapter's methods below, kept under the chapter's own name.

    def lookup(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of ``seq`` (vLLM: ``get_computed_blocks``). A sequence
        that must compute its whole prompt (prompt logprobs) reads nothing, but is counted."""
        if not seq.reads_prefix_cache:
            match = PrefixMatch.nothing(queried=seq.num_tokens)
        else:
            match = self._lookup_prefix_cache(seq)
        self._why_stopped(seq, match)
        return match

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        """Register the blocks that tokens [start, end) completed (vLLM: ``cache_blocks``)."""
        return self._do_prefill_step(seq, start, end)

    def load(self, seq: Sequence, match: PrefixMatch, fresh: list[Block]) -> None:
        """A plan admits ``match``: the blocks it read from the disk tier get their K/V in the
        first of its ``fresh`` blocks (free blocks nothing committed points at, so a dropped
        plan leaves nothing wrong). The commit registers them (``cache_blocks``)."""
        self.tier.place(seq, match.loaded, fresh)

    def stop_of(self, seq: Sequence) -> CacheMiss | None:
        """Why ``seq``'s latest lookup stopped where it did (None: never looked up)."""
        return self._stops.get(seq)

    def root_hash(self, cache_salt: str | None) -> int:
        """The chain's seed: 0, or the salt's hash, so differently salted requests never share.
        The salt is hashed in a domain no block reaches (``salt_bytes``), so no prompt can
        make its chain start where a salted one does."""
        return 0 if cache_salt is None else self.hash_fn(salt_bytes(cache_salt), 0)

    # ------------------------------------------------------------------ 1. the chain hash

    def _chain_hash(self, tokens: memoryview, prev_hash: int, start: int, end: int) -> int:
        """xxhash of token ids [start, end) as little-endian int64 bytes, seeded with the
        previous block's hash. ``tokens`` is a sequence's ``token_view()``: only the block's
        bytes are copied."""
        self.hash_computations += 1
        data = tokens[start:end].tobytes()
        ahead = self._ahead.get((data, prev_hash))  # hashed before a commit (prepare_saves)
        return ahead if ahead is not None else self.hash_fn(data, prev_hash)

    # ------------------------------------------------------------------ 2. the chapter's change
    # Everything that depends on ``hash_strategy`` is in this section, and only here
    # (tests/test_prefix_cache.py keeps it so): where a lookup gets its chain, and where a
    # save gets a block's hash. Then each column's own method: the chapter's, then the "before".

    def _chain_for_lookup(self, seq: Sequence) -> list[int]:
        """The chain a lookup probes with."""
        if self.hash_strategy == "recompute":
            return self._rebuild_chain(seq)      # the "before": every full block, every lookup
        self._precompute_block_hashes(seq)       # the chapter: only blocks not hashed yet
        return seq._block_hashes

    def _hash_for_save(self, seq: Sequence, index: int, parent: Block | None) -> int:
        """The hash ``seq``'s block ``index`` is saved under."""
        if self.hash_strategy == "recompute":
            return self._rehash_block(seq, index, parent)  # the "before": one more call
        if index >= len(seq._block_hashes):  # no lookup hashed it: hashed now, once
            in_prompt = (index + 1) * self.block_size <= seq.num_prompt_tokens
            self._precompute_block_hashes(seq, HashSource.SAVE if in_prompt else HashSource.DECODE)
        else:  # the chapter: the lookup already hashed it; read it, no call
            self._trace("reuse", seq, index, seq._block_hashes[index], source=HashSource.REUSED)
        return seq._block_hashes[index]

    def _hash_ahead(self, seq: Sequence, first: int, last: int, parent_hash: int) -> None:
        """Ahead of a commit (``prepare_saves``): the hash calls its saves of blocks [first,
        last) will make, made now; ``_chain_hash`` reads their results."""
        if self.hash_strategy == "recompute":  # each saved block, from its parent's hash
            todo, prev = range(first, last), parent_hash
        elif last > len(seq._block_hashes):   # the chain, extended to every full block
            todo, prev = range(len(seq._block_hashes), seq.num_tokens // self.block_size), seq._prev_hash
        else:
            return
        bs, tokens = self.block_size, seq.token_view()
        for index in todo:
            data = tokens[index * bs:(index + 1) * bs].tobytes()
            h = self._ahead[data, prev] = self.hash_fn(data, prev)  # keyed by the parent's hash
            prev = h

    def _precompute_block_hashes(self, seq: Sequence, source: HashSource = HashSource.PRECOMPUTED) -> None:
        """The chapter: extend ``seq._block_hashes`` to all its full blocks; a no-op when it is
        up to date. So each block is hashed once per Sequence: a cold lookup hashes the
        prompt's N blocks, a block completed during decode is hashed when it is saved."""
        bs, hashes, tokens = self.block_size, seq._block_hashes, seq.token_view()
        for start in range(len(hashes) * bs, seq.num_tokens - bs + 1, bs):
            parent = seq._prev_hash
            hashes.append(self._chain_hash(tokens, parent, start, start + bs))
            self._trace("hash", seq, len(hashes) - 1, hashes[-1], parent, source=source)

    def _rebuild_chain(self, seq: Sequence) -> list[int]:
        """The "before": hash every full block from the chain's seed (N calls per lookup).
        Nothing is kept on the Sequence."""
        bs, tokens = self.block_size, seq.token_view()
        chain, prev = [], seq._root_hash
        for start in range(0, seq.num_tokens - bs + 1, bs):
            parent, prev = prev, self._chain_hash(tokens, prev, start, start + bs)
            chain.append(prev)
            self._trace("hash", seq, len(chain) - 1, prev, parent, source=HashSource.RECOMPUTED)
        return chain

    def _rehash_block(self, seq: Sequence, index: int, parent: Block | None) -> int:
        """The "before" at save: hash the block again, chained from its parent block's hash."""
        bs = self.block_size
        prev = parent.block_hash if parent is not None else seq._root_hash
        h = self._chain_hash(seq.token_view(), prev, index * bs, (index + 1) * bs)
        self._trace("hash", seq, index, h, prev, source=HashSource.RECOMPUTED_AT_SAVE)
        return h

    # ------------------------------------------------------------------ 3. lookup

    def _lookup_prefix_cache(self, seq: Sequence) -> PrefixMatch:
        """Longest verified cached prefix of ``seq``, and whether its next block is in flight.

        Incremental, the chain is precomputed once (a cold sequence) and then only read, so a
        lookup is dict probes (``_chain_for_lookup``). Scans forward and stops at the first miss: the chain makes a
        later hit impossible. Each hit is checked against the block's tokens, parent and salt,
        so a hash collision costs a miss, never a wrong token. The last token is never served
        from cache, since its logits are needed.
        """
        chain = self._chain_for_lookup(seq)
        max_blocks = min((seq.num_tokens - 1) // self.block_size, len(chain))
        blocks: list[Block] = []
        while len(blocks) < max_blocks:
            block = self._prefix_cache.get(chain[len(blocks)])
            if block is None or not self._holds(block, seq, len(blocks), blocks):
                break  # the "miss" is traced with its reason by ``lookup`` (section 7)
            self._trace("hit", seq, len(blocks), block.block_hash, block_id=block.block_id)
            blocks.append(block)
        loaded = self.tier.probe(seq, chain, len(blocks), max_blocks)  # the pool missed: the disk's turn
        n = len(blocks) + len(loaded)
        next_in_flight = n < max_blocks and self._is_in_flight(seq, n, chain)
        return PrefixMatch(blocks, n * self.block_size, chain, next_in_flight, seq.num_tokens, loaded)

    def _holds(self, block: Block, seq: Sequence, index: int, parents: list[Block]) -> bool:
        """True if cached ``block`` holds exactly ``seq``'s block ``index`` after ``parents``."""
        parent = parents[-1].lifetime if parents else None
        return (block.parent == parent and block.salt == seq.cache_salt
                and block.token_bytes == seq.block_bytes(index, self.block_size))

    # ------------------------------------------------------------------ 4. the in-flight rule

    def _is_in_flight(self, seq: Sequence, index: int, chain: list[int]) -> bool:
        """True if another running sequence is computing ``seq``'s block ``index`` right now.

        Admitting ``seq`` now would compute the block twice; one step later it is a hit.
        """
        owner = self._in_flight.get(chain[index]) or self._planned.get(chain[index])
        return owner is not None and owner is not seq

    def mark_in_flight(self, seq: Sequence, match: PrefixMatch) -> None:
        """``seq`` was admitted: the full blocks after its cached prefix are now being computed."""
        first = len(match.blocks)
        ours = [h for h in match.chain[first:] if h not in self._in_flight]
        for h in ours:
            self._in_flight[h] = seq
        if ours:
            self._computing[seq] = ours

    def plan_in_flight(self, seq: Sequence, match: PrefixMatch) -> None:
        """A step's plan admits ``seq``: its blocks count as in flight for the rest of the plan
        (``mark_in_flight`` makes it so at the commit)."""
        for h in match.chain[len(match.blocks):]:
            if h not in self._in_flight:
                self._planned.setdefault(h, seq)

    def forget_plan(self) -> None:
        """A step's plan was committed or dropped: its marks are no longer planned."""
        self._planned.clear()
        self._ahead.clear()

    def unmark_in_flight(self, seq: Sequence) -> None:
        """``seq`` left the running set (finished, preempted, aborted): drop its in-flight marks."""
        for h in self._computing.pop(seq, ()):
            if self._in_flight.get(h) is seq:
                del self._in_flight[h]

    # ------------------------------------------------------------------ 5. saving

    def prepare_saves(self, seq: Sequence, start: int, end: int, block_table: list[int]) -> None:
        """Before a commit changes anything: run the hash function for every block that saving
        tokens [start, end) of ``seq`` (over ``block_table``) will hash, and keep the results,
        so the commit itself runs no hash function (a swapped ``hash_fn`` may raise; a commit
        must not stop half way). The saves still count and trace each hash as they use it."""
        bs = self.block_size
        first, last = start // bs, end // bs
        parent = self.block_manager.blocks[block_table[first - 1]] if first else None
        if last > first and (parent is None or parent.block_hash is not None):  # else nothing is saved
            self._hash_ahead(seq, first, last, parent.block_hash if parent else seq._root_hash)

    def _do_prefill_step(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        """Tokens [start, end) of ``seq`` now have K/V in the pool: register every block they
        completed (all block boundaries inside the chunk, not just its end; a decode token is
        a chunk of one). Returns (index, cached twin) for each block another sequence had
        already registered with identical content: the scheduler switches ``seq`` to the twin,
        and the next block already chains from it."""
        bs, blocks, twins = self.block_size, self.block_manager.blocks, []
        parent = blocks[seq.block_table[start // bs - 1]] if start >= bs else None
        for index in range(start // bs, end // bs):
            block = blocks[seq.block_table[index]]
            twin = self._save_prefix_cache(seq, index, block, parent)
            if twin is not None:
                twins.append((index, twin))
            parent = twin or block
        return twins

    def _save_prefix_cache(self, seq: Sequence, index: int, block: Block,
                           parent: Block | None) -> Block | None:
        """Register ``block``, ``seq``'s block ``index`` (its K/V are written), under its chain
        hash, after ``parent`` (None for the first block).

        A block whose parent is not cached is skipped: lookups walk from cached parents, so it
        could never be reached. Returns an identical block that is already cached, if any.
        """
        if block.block_hash is not None or (parent is not None and parent.block_hash is None):
            return None
        h = self._hash_for_save(seq, index, parent)
        self._in_flight.pop(h, None)
        existing = self._prefix_cache.get(h)
        if existing is None:
            block.set_identity(h, seq.block_bytes(index, self.block_size),
                               parent.lifetime if parent else None, seq.cache_salt)
            self._prefix_cache[h] = block
            self._trace("save", seq, index, h, block_id=block.block_id)
            return None
        if self._holds(existing, seq, index, [parent] if parent else []):
            self._trace("twin", seq, index, h, block_id=existing.block_id)
            return existing
        return None  # a hash collision: the first block keeps the entry, this one stays private

    # ------------------------------------------------------------------ 6. eviction and reset

    def evict(self, block: Block, for_seq: Sequence | None = None) -> None:
        """A free block that still carried a hash is being reused (for ``for_seq``, when the
        scheduler says): its entry leaves the map."""
        if self._prefix_cache.get(block.block_hash) is block:
            del self._prefix_cache[block.block_hash]
        self._trace("evict", None, None, block.block_hash, block_id=block.block_id)
        self.num_evictions += 1
        whom = f"reused for request {for_seq.request_id!r}" if for_seq is not None else "reused"
        self._remember_eviction(block, f"the cache's eviction {self.num_evictions}: pool block "
                                       f"{block.block_id} {whom}")
        block.forget_identity()

    def reset(self) -> bool:
        """Forget every cached-and-free block (in-use blocks keep serving their sequences).
        True if nothing cached is in use any more (vLLM's ``reset_prefix_cache`` result)."""
        for h, block in list(self._prefix_cache.items()):
            if block.ref_count == 0:
                del self._prefix_cache[h]
                self._trace("forget", None, None, h, block_id=block.block_id)
                self._remember_eviction(block, "forgotten by reset_prefix_cache()")
                block.forget_identity()
        if not self._prefix_cache:
            self._trace("clear", None, None, None)  # cache events: vLLM's AllBlocksCleared
        return not self._prefix_cache

    @property
    def entries(self) -> Mapping[int, Block]:
        """A read-only view of the map (hash -> cached block)."""
        return MappingProxyType(self._prefix_cache)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._prefix_cache)

    # ------------------------------------------------------------------ 7. why a lookup stopped
    # Every lookup stops somewhere; ``lookup`` says why, on a "miss" event and per sequence
    # (``stop_of``: a request's output carries it as ``cache_miss_reason``). Read off the maps and
    # the match only: no hash is computed, and the chapter's methods never call this.

    def _why_stopped(self, seq: Sequence, match: PrefixMatch) -> CacheMiss:
        """Trace the lookup's stop ("miss", then "wait" if it waits) and keep it for ``seq``."""
        index, chain = match.num_served_blocks, match.chain
        h = chain[index] if index < len(chain) else None
        stop = self._stop_reason(seq, match, index, h)
        waits, first = self._waits.pop(seq, (0, stop))
        if stop.reason is MissReason.IN_FLIGHT:
            self._waits[seq] = (waits + 1, first)
        elif waits:  # it waited for an in-flight block before: the stop says so
            stop = CacheMiss(stop.reason, stop.block, f"{stop}; after waiting {waits} step"
                             f"{'s' * (waits != 1)} for block {first.block}, in flight", stop.position, waits)
        self._trace("miss", seq, index, h, reason=stop)
        if stop.reason is MissReason.IN_FLIGHT:
            self._trace("wait", seq, index, h)
        self._stops[seq] = stop
        return stop

    def _stop_reason(self, seq: Sequence, match: PrefixMatch, index: int, h: int | None) -> CacheMiss:
        bs = self.block_size
        last = seq.num_tokens - 1
        if not seq.reads_prefix_cache:
            return CacheMiss(MissReason.NOT_READ, 0, "block 0: the request reads no cache (it asked "
                             "for prompt logprobs, so it computes its whole prompt)")
        if match.next_in_flight and h is not None:
            owner = self._in_flight.get(h) or self._planned.get(h)
            who = f"request {owner.request_id!r} is computing it" if owner is not None else "in flight"
            return CacheMiss(MissReason.IN_FLIGHT, index, f"block {index}: in flight ({who}): the "
                             f"request waits a step, then it is a hit")
        if index >= last // bs or h is None:  # every block before the last token's was served
            if (last + 1) % bs == 0 and h is not None:
                return CacheMiss(MissReason.LAST_TOKEN, index, f"block {index}: it holds the last "
                                 f"token (position {last}), which is never served from cache (its "
                                 f"logits are needed)")
            return CacheMiss(MissReason.PARTIAL_BLOCK, index, f"block {index}: tokens {index * bs}-"
                             f"{last} are a partial block (only a full block of {bs} is cached)")
        entry = self._prefix_cache.get(h)
        if entry is None:
            return self._no_entry(seq, index, h)
        mine, theirs = seq.block_bytes(index, bs), entry.token_bytes or b""
        if mine != theirs:
            k = next((k for k in range(bs) if mine[8 * k:8 * k + 8] != theirs[8 * k:8 * k + 8]), 0)
            return CacheMiss(MissReason.COLLISION, index, f"block {index}: the entry under its hash "
                             f"(pool block {entry.block_id}) holds other tokens, a hash collision: "
                             f"they first differ at token position {index * bs + k}", index * bs + k)
        if entry.salt != seq.cache_salt:
            return self._other_salt(index)
        return CacheMiss(MissReason.OTHER_PARENT, index, f"block {index}: the entry under its hash "
                         f"(pool block {entry.block_id}) holds these tokens after another parent block "
                         f"(block {index - 1} was evicted and computed again, or a hash collision)")

    def _no_entry(self, seq: Sequence, index: int, h: int) -> CacheMiss:
        evicted = self._evicted.get(h)
        if evicted is not None:
            return CacheMiss(MissReason.EVICTED, index, f"block {index}: no entry for its hash: "
                             f"evicted ({evicted})")
        if seq.cache_salt is not None:  # its own salt's domain, never a look into another's
            return self._other_salt(index)
        older = (f" (or evicted before the last {EVICTIONS_REMEMBERED} evictions, which the cache "
                 f"remembers)" if self._evictions_forgotten else "")
        return CacheMiss(MissReason.NEVER_SAVED, index, f"block {index}: no entry for its hash: never "
                         f"saved{older}")

    @staticmethod
    def _other_salt(index: int) -> CacheMiss:
        return CacheMiss(MissReason.OTHER_SALT, index, f"block {index}: no entry under this request's "
                         f"cache_salt (only requests with the same salt share blocks; whether "
                         f"another salt holds these tokens is never told)")

    def _remember_eviction(self, block: Block, what: str) -> None:
        self._evicted[block.block_hash] = what
        self._evicted.move_to_end(block.block_hash)
        if len(self._evicted) > EVICTIONS_REMEMBERED:
            self._evicted.popitem(last=False)
            self._evictions_forgotten = True

    # ------------------------------------------------------------------ watching it work

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[ChainEvent]]:
        """``with cache.recording() as events:`` -- every event while the block runs, in order."""
        events: list[ChainEvent] = []
        self.subscribe(events.append)
        try:
            yield events
        finally:
            self.unsubscribe(events.append)

    def subscribe(self, listener: Callable[[ChainEvent], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[ChainEvent], None]) -> None:
        self._listeners.remove(listener)

    def _trace(self, kind: str, seq: Sequence | None, index: int | None, block_hash: int | None,
               parent_hash: int | None = None, block_id: int | None = None,
               source: HashSource | None = None, reason: CacheMiss | None = None) -> None:
        if self._listeners:
            event = ChainEvent(kind, seq.request_id if seq else None, index, block_hash,
                               parent_hash, block_id, source, reason)
            for listener in list(self._listeners):
                listener(event)


class NoTier:
    """Nothing under the pool: a lookup's misses stop there. (The engine's disk tier,
    core/kv_disk.py, answers the same two calls: ``probe`` while a lookup plans, ``place`` when
    the plan takes the fresh blocks.)"""

    enabled = False

    def probe(self, seq: Sequence, chain: list[int], first: int, last: int) -> list:
        return []

    def place(self, seq: Sequence, loaded: list, blocks: list[Block]) -> None:
        pass


def salt_bytes(cache_salt: str) -> bytes:
    """The salt as hashed: its UTF-8 bytes, then 0xff (never in UTF-8) up to a length of 8k + 1.
    A block's bytes are whole int64 ids (8k bytes), so no block can hash to a salt's root."""
    data = cache_salt.encode()
    return data + b"\xff" * (9 - len(data) % 8)


class NoPrefixCache(PrefixCache):
    """Prefix caching off: every lookup misses and asks for nothing, nothing is saved."""

    enabled = False

    def lookup(self, seq: Sequence) -> PrefixMatch:
        return PrefixMatch.nothing()

    def stop_of(self, seq: Sequence) -> CacheMiss:
        return CACHING_OFF

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        return []

    def prepare_saves(self, seq: Sequence, start: int, end: int, block_table: list[int]) -> None:
        pass

    def root_hash(self, cache_salt: str | None) -> int:
        return 0
