"""The build-it-yourself track's skeleton: the chapter's methods, for you to design and write.

``python -m track start`` copies this file to ``track/my_prefix_cache.py``; write there, never
here (this copy stays untouched, so ``python -m track reset`` can give it back and the test
suite can check that the untouched skeleton fails every step).

``MyPrefixCache`` is the engine's ``PrefixCache`` (prefix_cache.py) with the chapter's methods
emptied. Each docstring below says what the method must guarantee (its contract) and the rules
it keeps, never how: the how is yours to design. Where the chapter (step14_5.md) shows code
for a method, the docstring shows it too, as the chapter wrote it: that code goes wrong in this
engine, and finding where is part of the step. A failing check names the scenario, what
differed from the engine, and the rule your code broke.

Everything else is given and already works: the block manager and its pool, the scheduler that
plans each step and then commits it, the model, and in the cache itself ``_holds``,
``_is_in_flight``, ``mark_in_flight`` / ``plan_in_flight``, ``prepare_saves``, ``release``,
``evict``, ``reset``, ``root_hash``, the miss reasons (``lookup`` tells why yours stopped) and
the recording of events (``self._trace``: optional in your code; the checks never read your
events).

The steps, in order (``python -m track check N`` checks step N; see track/README.md):

1. ``_chain_hash``                 one block's name
2. ``_precompute_block_hashes``    a sequence's chain, kept on it
3. ``_lookup_prefix_cache``        the longest prefix the cache can serve
4. ``_do_prefill_step``, ``_save_prefix_cache``, ``_hash_for_save`` (incremental branch)
                                   registering what a step computed
5. ``_rebuild_chain``, ``_hash_for_save`` (recompute branch)
                                   the chapter's "before", kept runnable as the baseline

What you can use (all given):

* ``self.hash_fn(data: bytes, seed: int) -> int``: xxh3_64 unless a test swaps it (some swap in
  one that collides on purpose, or one that raises when a commit calls it);
* ``self.hash_computations``: the counter of hash calls; the chapter's table counts it;
* ``self._ahead``: ``{(block bytes, seed): hash}``, computed by ``prepare_saves`` just before a
  step's commit, for the hashes that commit's saves will need (a commit runs no hash function);
* ``self.block_size``; ``self._prefix_cache``: the map, hash -> cached ``Block``;
  ``self._in_flight``: hash -> the running ``Sequence`` computing that block;
* ``seq.token_view()``: the token ids as a memoryview of little-endian int64 (slice it, then
  ``.tobytes()``); ``seq.num_tokens`` (prompt and generated), ``seq.num_prompt_tokens``;
  ``seq._root_hash``: the chain's seed (0, or the cache_salt's hash); ``seq._block_hashes``:
  the sequence's chain, a list; ``seq._prev_hash``: its last value (a property that follows
  ``_block_hashes``); ``seq.block_table``: the sequence's block ids;
  ``seq.block_bytes(index, block_size)``; ``seq.cache_salt``;
* ``self.block_manager.blocks[block_id]``: a ``Block``; ``block.block_hash`` (None unless it is
  cached), ``block.lifetime``, ``block.set_identity(hash, token_bytes, parent_lifetime, salt)``;
* ``self._holds(block, seq, index, parents)``: is cached ``block`` really ``seq``'s block
  ``index`` after the blocks ``parents``? ``self._is_in_flight(seq, index, chain)``: is another
  running sequence computing ``seq``'s block ``index`` right now?
* ``PrefixMatch(blocks, num_cached_tokens, chain, next_in_flight, queried)``.

A sequence lives longer than one lookup: it is planned, admitted, prefilled in chunks over
several steps, decodes, may be preempted (its blocks freed, full ones staying cached) and comes
back as the same object, looked up again, and prefilled again from where that lookup stops.

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
        """The name of one block: token ids [start, end) of ``tokens`` (a ``token_view()``),
        after the block whose name is ``prev_hash`` (or the chain's seed).

        Contract: equal ids after an equal ``prev_hash`` give an equal name, in any process;
        anything else gives another name, but for a hash collision.
        Rules: every call counts once in ``self.hash_computations`` (that counter is the
        chapter's table); the name covers the block and nothing else of the buffer; a commit
        runs no hash function (use what ``prepare_saves`` put in ``self._ahead``).

        The chapter calls it as ``self._chain_hash(seq.prompt_ids.tolist(), seq._prev_hash,
        end - self.block_size, end)``. Here the tokens come as a view of a buffer that also holds
        what comes after the block.
        """
        raise NotImplementedError("step 1: write _chain_hash")

    # ------------------------------------------------------------------ step 2: the cold precompute

    def _precompute_block_hashes(self, seq: Sequence, source: HashSource = HashSource.PRECOMPUTED) -> None:
        """Bring ``seq``'s chain up to date.

        Contract: afterwards ``seq._block_hashes[i]`` is the name of ``seq``'s block ``i`` for every
        full block of its tokens, prompt and generated, chained from ``seq._root_hash``.
        Rules: a block is hashed at most once per Sequence; an entry, once in the list, never
        changes (the tokens it names never do). ``source`` only labels your ``_trace`` events.

        The chapter precomputes only for a cold request::

            if not seq._block_hashes:
                self._precompute_block_hashes(seq)

        Decide whether that guard is enough for a sequence of this engine, which keeps growing
        after its prompt and can come back after a preemption.
        """
        raise NotImplementedError("step 2: write _precompute_block_hashes")

    # ------------------------------------------------------------------ step 3: the lookup

    def _lookup_prefix_cache(self, seq: Sequence) -> PrefixMatch:
        """The longest prefix of ``seq`` the cache can serve now, as a ``PrefixMatch``.

        Contract: ``blocks`` are cached blocks that hold exactly ``seq``'s blocks 0, 1, ... in
        order (a prefix: every block before a served one is served); ``num_cached_tokens`` are
        their tokens; ``chain`` names every full block of ``seq`` (the scheduler marks the
        ones after the prefix as being computed by ``seq``); ``queried`` is every token of
        ``seq``; ``next_in_flight`` says whether ``seq`` should wait a step because another
        running sequence is computing the block it would be served next.
        Rules: a hash names a block, it does not prove it (two blocks can share a hash); the
        last token is never served (its logits are needed); under "incremental" a Sequence's
        blocks are hashed once, however often it is looked up; under "recompute" (the
        "before", step 5) the chain is ``self._rebuild_chain(seq)`` at every lookup; a block
        that could never be served is never a reason to wait.

        The chapter's lookup::

            if not seq._block_hashes:
                self._precompute_block_hashes(seq)
            for i in range(len(seq._block_hashes) - 1, -1, -1):
                h = seq._block_hashes[i]
                if h in self._prefix_cache:
                    entry = self._prefix_cache[h]
                    ...
                    return cached_block_ids, entry["length"], h
            return [], 0, 0

        It breaks more than one of the rules above in this engine. Decide which, and why,
        before you write yours.
        """
        raise NotImplementedError("step 3: write _lookup_prefix_cache")

    # ------------------------------------------------------------------ step 4: the save during prefill

    def _do_prefill_step(self, seq: Sequence, start: int, end: int) -> list[tuple[int, Block]]:
        """Tokens [start, end) of ``seq`` now have K/V in the pool (one step's chunk: a part of
        a prompt, a re-prefill after a preemption, or one decode token): register what they
        completed, through ``_save_prefix_cache``.

        Contract: every block the chunk filled is offered to the cache, in order, each after
        its parent (the block before it in ``seq``'s block table, as it stands when this runs;
        none for block 0). Return ``(index, twin)`` for each block an identical cached block
        replaces: the scheduler then switches ``seq`` to the twin, which is also the next
        block's parent.
        Rules: a chunk is not a request (where it starts and ends says nothing about blocks);
        nothing about one call is kept for the next (between two chunks the sequence may have
        been preempted and looked up again).

        The chapter's step::

            if end % self.block_size == 0 and end <= prompt_len:
                h = self._chain_hash(seq.prompt_ids.tolist(), seq._prev_hash,
                                     end - self.block_size, end)
                seq._block_hashes.append(h)
                seq._prev_hash = h
                self._save_prefix_cache(seq, h, end)

        Run after the chapter's own lookup, it goes wrong in several ways (exercise 1 measures
        one). Decide where before you write yours.
        """
        raise NotImplementedError("step 4: write _do_prefill_step")

    def _save_prefix_cache(self, seq: Sequence, index: int, block: Block,
                           parent: Block | None) -> Block | None:
        """Offer ``block``, ``seq``'s block ``index``, to the cache, after ``parent``.

        Contract: afterwards a lookup that walks to this block from its parent finds it
        (registered now or before), or this block stays private. Return the cached block that
        holds the same content (its twin), if there is one; None otherwise.
        Rules: only a block a lookup could reach is registered (a lookup walks from block 0
        through cached blocks); the map keeps the first block registered under a hash; a twin
        is a block that ``_holds`` accepts, never just a block under the same hash; once this
        block's fate is decided, no sequence waits for its hash any more (``self._in_flight``);
        a registered block carries its name, its tokens, its parent's lifetime and its salt
        (``set_identity``), and only a registered block carries a name: a twin's own copy is
        freed by the scheduler and must come back as a plain free block.
        """
        raise NotImplementedError("step 4: write _save_prefix_cache")

    def _hash_for_save(self, seq: Sequence, index: int, parent: Block | None) -> int:
        """The name block ``index`` of ``seq`` is registered under.

        Incremental (step 4): the chapter's point, a block is hashed once per Sequence; some
        blocks reach their save with no lookup having hashed them (decide which).
        Recompute (the "before", step 5): the name is computed again for this save, from what
        the save is given, never from anything the Sequence keeps.
        """
        if self.hash_strategy == "recompute":
            raise NotImplementedError("step 5: write the recompute branch of _hash_for_save")
        raise NotImplementedError("step 4: write the incremental branch of _hash_for_save")

    # ------------------------------------------------------------------ step 5: the "before"

    def _rebuild_chain(self, seq: Sequence) -> list[int]:
        """The chapter's "before" (its Paged Prefix Cache): ``seq``'s chain, built from the seed
        at every lookup and kept nowhere (``seq._block_hashes`` is left as it is).

        Contract: the same names ``_precompute_block_hashes`` gives, for the same blocks.

        The chapter's "before"::

            prev_hash = 0
            block_hashes = []
            for start in range(0, prompt_len - prompt_len % self.block_size, self.block_size):
                h = self._chain_hash(tokens, prev_hash, start, start + self.block_size)
                block_hashes.append((end, h))
                prev_hash = h

        It uses two names it never defines, and a seed this engine does not always use. Decide
        what each must be here.
        """
        raise NotImplementedError("step 5: write _rebuild_chain")
