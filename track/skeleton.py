"""The build-it-yourself track's skeleton: the chapter's methods, for you to write.

``python -m track start`` copies this file to ``track/my_prefix_cache.py``; write there, never
here (this copy stays untouched, so ``python -m track reset`` can give it back and the test
suite can check that the untouched skeleton fails every step).

``MyPrefixCache`` is the engine's ``PrefixCache`` (prefix_cache.py) with the chapter's
methods emptied. Everything else is given and already works: the block manager and its
pool, the scheduler that calls the cache, the model, and in the cache itself ``_holds`` (is
a cached block really this sequence's block?), ``_is_in_flight`` (the in-flight rule),
``mark_in_flight``, ``release``, ``evict``, ``reset``, ``root_hash`` and the recording of
events (``self._trace``: optional in your code; the checks never read your events).

The steps, in order (``python -m track check N`` checks step N; see track/README.md):

1. ``_chain_hash``                 one block's hash, seeded with the previous block's hash
2. ``_precompute_block_hashes``    the cold precompute: extend ``seq._block_hashes`` once
3. ``_lookup_prefix_cache``        the lookup: the longest cached prefix, no hash recomputed
4. ``_do_prefill_step``, ``_save_prefix_cache``, ``_hash_for_save`` (incremental branch)
                                   the save during prefill, reusing the sequence's hashes
5. ``_rebuild_chain``, ``_hash_for_save`` (recompute branch)
                                   the "before" (Paged Prefix Cache), kept as the baseline

What you can use (all given):

* ``self.hash_fn(data: bytes, seed: int) -> int``: xxh3_64 unless a test swaps it;
* ``self.hash_computations``: the counter of hash calls the chapter's table counts;
* ``self.block_size``; ``self._prefix_cache``: the map, hash -> cached ``Block``;
* ``seq.token_view()``: the token ids as a memoryview of little-endian int64 (slice it, then
  ``.tobytes()``); ``seq.num_tokens``; ``seq._root_hash``: the chain's seed (0, or the
  cache_salt's hash); ``seq._block_hashes``: the sequence's chain, a list you extend;
  ``seq._prev_hash``: its last value (a property: it follows ``_block_hashes`` by itself);
  ``seq.block_table``: the sequence's block ids; ``seq.block_bytes(index, block_size)``;
* ``self.block_manager.blocks[block_id]``: a ``Block``; ``block.block_hash`` (None until it
  is cached), ``block.lifetime``, ``block.set_identity(hash, token_bytes, parent_lifetime,
  salt)``;
* ``PrefixMatch(blocks, num_cached_tokens, chain, next_in_flight, queried)``: ``queried`` is
  the number of tokens looked up (all of ``seq``'s: the hit rate's denominator).

The engine's own ``prefix_cache.py`` is the reference solution: reading it first spoils the
track, so try each step before you look.
"""
from __future__ import annotations

from block_manager import Block
from prefix_cache import HashSource, PrefixCache, PrefixMatch  # noqa: F401 -- yours to use
from scheduler import Sequence


class MyPrefixCache(PrefixCache):
    """The chapter's prefix cache, written by you, one step at a time."""

    # ------------------------------------------------------------------ step 1: the chain hash

    def _chain_hash(self, tokens: memoryview, prev_hash: int, start: int, end: int) -> int:
        """Hash of token ids [start, end) of ``tokens`` (a ``token_view()``), seeded with
        ``prev_hash``, the hash of the block before (or the chain's seed). Every call counts
        once in ``self.hash_computations``: that counter is the chapter's table."""
        raise NotImplementedError("step 1: write _chain_hash")

    # ------------------------------------------------------------------ step 2: the cold precompute

    def _precompute_block_hashes(self, seq: Sequence, source: HashSource = HashSource.PRECOMPUTED) -> None:
        """Extend ``seq._block_hashes`` to every full block of ``seq``'s tokens (prompt and
        generated ones), chained from ``seq._prev_hash``. Each block is hashed once per
        Sequence: a block already in the list is never hashed again."""
        raise NotImplementedError("step 2: write _precompute_block_hashes")

    # ------------------------------------------------------------------ step 3: the lookup

    def _lookup_prefix_cache(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of ``seq``, as a ``PrefixMatch``.

        Incremental (``self.hash_strategy == "incremental"``): a cold sequence's chain is
        precomputed once (step 2), then only read. For "recompute" use ``self._rebuild_chain(seq)``
        (step 5) as the chain instead. Walk the chain from block 0 and stop at the first block
        that is not cached, or whose cached block does not hold this sequence's tokens (check
        with ``self._holds``: two different blocks can share a hash). The last token is never
        served from cache (its logits are needed). If the next block after the prefix is being
        computed by another sequence (``self._is_in_flight``), say so in ``next_in_flight``.
        ``chain`` is the hash of every full block of ``seq``; ``queried``, its number of tokens.
        """
        raise NotImplementedError("step 3: write _lookup_prefix_cache")

    # ------------------------------------------------------------------ step 4: the save during prefill

    def _do_prefill_step(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        """Tokens [start, end) of ``seq`` now have K/V in the pool: save every block they
        completed (every block boundary inside the chunk, not only its end; a decode token is
        a chunk of one) with ``_save_prefix_cache``. A block's parent is the block before it in
        ``seq``'s block table, at a chunk's start too (None only for block 0). Return (index,
        twin) for each block that an identical, already cached twin replaces (the scheduler
        switches ``seq`` to it, and the next block's parent is then the twin)."""
        raise NotImplementedError("step 4: write _do_prefill_step")

    def _save_prefix_cache(self, seq: Sequence, index: int, block: Block,
                           parent: Block | None) -> Block | None:
        """Register ``block``, ``seq``'s block ``index``, under its chain hash
        (``_hash_for_save``), after ``parent`` (None for block 0). Skip a block that is already
        cached, or whose parent is not (no lookup could reach it). Otherwise its hash is no longer
        in flight (``self._in_flight``), whatever the map holds. If the map already holds an identical
        block (``_holds``), return it: the twin. A different block under the same hash (a
        collision) keeps the entry; this one stays private."""
        raise NotImplementedError("step 4: write _save_prefix_cache")

    def _hash_for_save(self, seq: Sequence, index: int, parent: Block | None) -> int:
        """The hash block ``index`` is saved under. Incremental: the sequence already has it,
        unless no lookup hashed it (a block completed during decode, or a prompt that reads no
        cache): then extend the chain (step 2).
        Recompute (the "before", step 5): hash the block again, chained from ``parent``'s hash
        (or the chain's seed for block 0)."""
        if self.hash_strategy == "recompute":
            raise NotImplementedError("step 5: write the recompute branch of _hash_for_save")
        raise NotImplementedError("step 4: write the incremental branch of _hash_for_save")

    # ------------------------------------------------------------------ step 5: the "before"

    def _rebuild_chain(self, seq: Sequence) -> list[int]:
        """The chapter's "before" (its Paged Prefix Cache): the chain of every full block of
        ``seq``, rebuilt from the seed at every lookup, kept nowhere (``seq._block_hashes``
        stays as it is)."""
        raise NotImplementedError("step 5: write _rebuild_chain")
