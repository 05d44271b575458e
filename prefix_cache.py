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
from dataclasses import dataclass
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
                           # call), "hit", "miss", "wait", "save", "twin", "evict"; reset():
                           # "forget" (a cached-and-free block), then "clear" if none is left
    request_id: str | None  # None for "evict", "forget", "clear" (no request's block)
    index: int | None       # block index in the sequence; None for those three
    block_hash: int | None = None
    parent_hash: int | None = None
    block_id: int | None = None
    source: HashSource | None = None
    reason: str | None = None  # "miss": why that block is not served (section 7)


@dataclass
class PrefixMatch:
    """What a lookup found for one sequence."""

    blocks: list[Block]     # cached blocks serving its prefix, in order
    num_cached_tokens: int
    chain: list[int]        # hash of every full block the sequence has (to mark what it computes)
    next_in_flight: bool    # another running sequence is computing the block it needs next
    queried: int = 0        # tokens looked up (0 when the cache was not read)
    stop_reason: str | None = None  # why no more of the prompt is served (section 7)

    @classmethod
    def nothing(cls, queried: int = 0, reason: str | None = None) -> PrefixMatch:
        """No cached prefix, nothing to mark."""
        return cls([], 0, [], False, queried, reason)


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
        self._in_flight: dict[int, Sequence] = {}      # hash -> sequence computing it
        self._planned: dict[int, Sequence] = {}        # the same, for this step's admissions
        self._ahead: dict[tuple[bytes, int], int] = {}  # hash_fn results a commit will ask for
        self._gone: dict[int, str] = {}  # recently evicted or reset hashes -> how (section 7)
        self._computing: dict[Sequence, list[int]] = {}  # sequence -> hashes it marked (never edited in place)
        self.hash_computations = 0
        self.num_evictions = 0
        self._listeners: list[Callable[[ChainEvent], None]] = []

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
            return PrefixMatch.nothing(seq.num_tokens, "this request reads no cache (prompt_logprobs: "
                                                       "every prompt token is computed)")
        return self._lookup_prefix_cache(seq)

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        """Register the blocks that tokens [start, end) completed (vLLM: ``cache_blocks``)."""
        return self._do_prefill_step(seq, start, end)

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
            self._ahead[data, prev] = prev = self.hash_fn(data, prev)  # keyed by the parent, then on

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
        blocks, missed = [], None  # the cached blocks served; why the scan stopped, if it missed
        while len(blocks) < max_blocks:
            block = self._prefix_cache.get(chain[len(blocks)])
            if block is None or not self._holds(block, seq, len(blocks), blocks):
                missed = self._miss_reason(block, seq, len(blocks), chain[len(blocks)])
                self._trace("miss", seq, len(blocks), chain[len(blocks)], reason=missed)
                break
            self._trace("hit", seq, len(blocks), block.block_hash, block_id=block.block_id)
            blocks.append(block)
        next_in_flight = len(blocks) < max_blocks and self._is_in_flight(seq, len(blocks), chain)
        why = self._stop_reason(seq, len(blocks), missed, next_in_flight)
        return PrefixMatch(blocks, len(blocks) * self.block_size, chain, next_in_flight, seq.num_tokens, why)

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
        if owner is not None and owner is not seq:
            self._trace("wait", seq, index, chain[index])
            return True
        return False

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

    def release(self, seq: Sequence) -> None:
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
            self._gone.pop(h, None)
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

    def evict(self, block: Block) -> None:
        """A free block that still carried a hash is being reused: its entry leaves the map."""
        if self._prefix_cache.get(block.block_hash) is block:
            del self._prefix_cache[block.block_hash]
            self._note_gone(block.block_hash, "evicted (its block was reused)")
        self._trace("evict", None, None, block.block_hash, block_id=block.block_id)
        block.forget_identity()
        self.num_evictions += 1

    def reset(self) -> bool:
        """Forget every cached-and-free block (in-use blocks keep serving their sequences).
        True if nothing cached is in use any more (vLLM's ``reset_prefix_cache`` result)."""
        for h, block in list(self._prefix_cache.items()):
            if block.ref_count == 0:
                del self._prefix_cache[h]
                self._note_gone(h, "dropped by reset_prefix_cache()")
                self._trace("forget", None, None, h, block_id=block.block_id)
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

    # ------------------------------------------------------------------ 7. why a lookup stops
    # Every lookup says why it served no more than it did: on its "miss" event, on the match,
    # and (through the engine) in the request's output beside num_cached_tokens.

    def _miss_reason(self, entry: Block | None, seq: Sequence, index: int, block_hash: int) -> str:
        """Why block ``index`` of ``seq`` is not served: its hash has no entry (never cached,
        or gone: how), or the entry holds another salt, other tokens (a collision), another parent."""
        if entry is None:
            gone = self._gone.get(block_hash)
            return f"block {index}: no entry for its hash ({gone or 'never cached'})"
        if entry.salt != seq.cache_salt:
            return f"block {index}: the entry was cached under another cache_salt"
        if entry.token_bytes != seq.block_bytes(index, self.block_size):
            return f"block {index}: the entry holds other tokens (a hash collision)"
        return f"block {index}: the entry follows another parent block"

    def _stop_reason(self, seq: Sequence, served: int, missed: str | None, waits: bool) -> str:
        """Why the lookup served ``served`` blocks and no more."""
        bs, n = self.block_size, seq.num_tokens
        if waits:
            return f"block {served} is being computed by another request: this one waits a step"
        if missed is not None:
            return missed
        if n < bs:
            return f"the prompt ({n} tokens) is shorter than a block ({bs}): nothing to cache"
        if n % bs == 0 and served == n // bs - 1:
            return f"block {served} holds the last token, never served (its logits are needed)"
        return f"the last {n - served * bs} tokens are not a full block"

    def _note_gone(self, block_hash: int, how: str) -> None:
        self._gone[block_hash] = how
        if len(self._gone) > 4 * self.block_manager.num_blocks:  # a bounded memory of it
            del self._gone[next(iter(self._gone))]

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
               source: HashSource | None = None, reason: str | None = None) -> None:
        if self._listeners:
            event = ChainEvent(kind, seq.request_id if seq else None, index, block_hash,
                               parent_hash, block_id, source, reason)
            for listener in list(self._listeners):
                listener(event)


def salt_bytes(cache_salt: str) -> bytes:
    """The salt as hashed: its UTF-8 bytes, then 0xff (never in UTF-8) up to a length of 8k + 1.
    A block's bytes are whole int64 ids (8k bytes), so no block can hash to a salt's root."""
    data = cache_salt.encode()
    return data + b"\xff" * (9 - len(data) % 8)


class NoPrefixCache(PrefixCache):
    """Prefix caching off: every lookup misses and asks for nothing, nothing is saved."""

    enabled = False

    def lookup(self, seq: Sequence) -> PrefixMatch:
        return PrefixMatch.nothing(reason="prefix caching is off")

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        return []

    def prepare_saves(self, seq: Sequence, start: int, end: int, block_table: list[int]) -> None:
        pass

    def root_hash(self, cache_salt: str | None) -> int:
        return 0
