"""The track's scenarios for the rules that only a hash collision shows, and for chunk starts.

A real 64-bit hash never collides in a test, so code that skips a rule which only matters
under a collision would pass. Here the cache's ``hash_fn`` is swapped for one that collides on
purpose: a block's hash is its first token id plus the seed, so two blocks that start with the
same token after the same prefix share a hash. Each scenario checks one rule (the ``rule`` a
failure prints); steps 4 and 5 run the same scripts, under each strategy.
"""
from __future__ import annotations

from track.checks import (BLOCK, entries, match_of, new_cache, new_seq, prompt, run_to_end,
                          scenario, scheduler_for)

TAIL = 5  # tokens after the full blocks: a request's last token is never served from cache


def first_token_hash(data: bytes, seed: int) -> int:
    """A hash that collides on purpose: the block's first token id plus the seed (its parent's hash)."""
    if not isinstance(seed, int):
        raise TypeError(f"hash_fn's seed must be an int (the parent block's hash), got {seed!r}")
    return (int.from_bytes(data[:8], "little") + seed) % 2 ** 64


def weak_tokens(*firsts: int, fill: int) -> list[int]:
    """One block per entry of ``firsts``, starting with that token, the rest ``fill``; then a tail."""
    return [t for first in firsts for t in [first] + [fill] * (BLOCK - 1)] + [fill] * TAIL


def computed_once(cache, scheduler, tokens, name):
    """Admit a request and compute its whole prompt in one step; it keeps running."""
    seq = new_seq(cache, tokens, name)
    scheduler.add(seq)
    scheduler.commit(scheduler.schedule())
    return seq


def weak_setup(cls, strategy, budget: int = 2048):
    """A weak-hash cache in which request "a" (blocks starting 10, 20) was computed and finished;
    its scheduler computes ``budget`` tokens a step."""
    cache = new_cache(cls, strategy, hash_fn=first_token_hash)
    scheduler = scheduler_for(cache, budget)
    a = new_seq(cache, weak_tokens(10, 20, fill=1), "a")
    run_to_end(scheduler, a)
    return cache, scheduler


def map_of(cache) -> dict:
    return {"the map: cached block ids": [b.block_id for _, b in entries(cache)]}


def collision_at_save(cls, strategy):
    """"b" starts like "a" under the weak hash but holds other tokens: no twin, the entry stays."""
    cache, scheduler = weak_setup(cls, strategy)
    a_blocks = {b.block_id for b in cache.entries.values()}
    b = computed_once(cache, scheduler, weak_tokens(10, 20, fill=2), "b")
    return {"blocks of b's table that hold a's tokens": sorted(a_blocks.intersection(b.block_table)),
            "b's block table after its step": list(b.block_table)} | map_of(cache)


def saved_leaves_in_flight(cls, strategy):
    """After a request's save, a lookup that misses on the same hash has nothing to wait for."""
    cache, scheduler = weak_setup(cls, strategy)
    computed_once(cache, scheduler, weak_tokens(10, 20, fill=2), "b")   # block 0 collides with a's
    computed_once(cache, scheduler, weak_tokens(55, 66, fill=3), "e")   # both blocks saved
    return (match_of(cache, new_seq(cache, weak_tokens(10, fill=4), "d"), "d's lookup")
            | match_of(cache, new_seq(cache, weak_tokens(55, fill=5), "f"), "f's lookup"))


def orphan_child(cls, strategy):
    """"b"'s block 0 collides and stays private; its block 1 has a hash nobody holds."""
    cache, scheduler = weak_setup(cls, strategy)
    b = computed_once(cache, scheduler, weak_tokens(10, 77, fill=2), "b")
    return map_of(cache) | {"b's block table after its step": list(b.block_table)}


def orphan_child_chunked(cls, strategy):
    """The same, "b" prefilled one block a step: its block 1 is saved at the start of a chunk."""
    cache, scheduler = weak_setup(cls, strategy, budget=BLOCK)
    run_to_end(scheduler, new_seq(cache, weak_tokens(10, 77, fill=2), "b"))
    return map_of(cache)


# Two salts whose roots collide under the weak hash: salt_bytes starts with the same 8 bytes
SALTS = ("tenant-A-1", "tenant-A-2")


def twin_of_another_salt(cls, strategy):
    """"b" holds a's tokens under another cache_salt (same root under the weak hash) and computes
    its prompt without reading the cache (as with prompt logprobs): is it switched to a's blocks?"""
    cache = new_cache(cls, strategy, hash_fn=first_token_hash)
    scheduler = scheduler_for(cache)
    run_to_end(scheduler, new_seq(cache, weak_tokens(10, 20, fill=1), "a", SALTS[0]))
    a_blocks = {b.block_id for b in cache.entries.values()}
    b = new_seq(cache, weak_tokens(10, 20, fill=1), "b", SALTS[1], reads_prefix_cache=False)
    scheduler.add(b)
    scheduler.commit(scheduler.schedule())
    return {"blocks of b's table that hold a's tokens": sorted(a_blocks.intersection(b.block_table)),
            "b's block table after its step": list(b.block_table)} | map_of(cache)


def marked_then_saved_by_another(cls, strategy):
    """"y" is admitted (its blocks marked in flight) but computes nothing yet; "x" then saves a
    block under the hash y's block 1 has (a collision); "z" hits y's block 0, misses on that hash."""
    cache = new_cache(cls, strategy, hash_fn=first_token_hash)
    scheduler = scheduler_for(cache)
    run_to_end(scheduler, new_seq(cache, weak_tokens(12, fill=2), "a"))      # block 0 of y and z
    y = new_seq(cache, weak_tokens(12, 30, fill=2), "y")
    cache.mark_in_flight(y, cache.lookup(y))   # admitted, as the scheduler does: block 1 in flight
    computed_once(cache, scheduler, weak_tokens(5, 37, fill=3), "x")  # block 1: 37 + 5 = 30 + 12
    return match_of(cache, new_seq(cache, weak_tokens(12, 30, fill=2), "z"), "z's lookup")


TWIN_RULE = ("a block cached under the same hash is a twin only if it holds these tokens after this "
             "parent (_holds); otherwise it is a collision: the first block keeps the entry and this "
             "one stays private")
IN_FLIGHT_RULE = ("once a block's save is decided (saved, twin or collision) its hash is no longer in "
                  "flight, so a later lookup that misses on that hash never waits for it")
ORPHAN_RULE = ("a block whose parent is not cached is not saved: no lookup can reach it, "
               "and the 'before' would have no parent hash to chain it from")
CHUNK_ORPHAN_RULE = ("a chunk's first block has the sequence's own block before it as its parent, "
                     "cached or not (never the map's block under that hash): a block after one that "
                     "stayed private is not saved, whichever chunk it is in")
SALT_TWIN_RULE = ("a twin is a block _holds accepts: the same tokens after the same parent under the "
                  "same cache_salt; a block of another salt under the same hash is a collision, "
                  "never shared across salts")

for step, strategy in ((4, "incremental"), (5, "recompute")):
    where = "" if step == 4 else ", under recompute"
    for name, script, rule in (
            ("a collision at save: a cached block under the same hash holds other tokens",
             collision_at_save, TWIN_RULE),
            ("in flight after a save: a lookup misses on a hash another request has saved",
             saved_leaves_in_flight, IN_FLIGHT_RULE),
            ("a block after a private one (its parent collided, so is not cached)", orphan_child,
             ORPHAN_RULE),
            ("a block after a private one, prefilled one block a step", orphan_child_chunked,
             CHUNK_ORPHAN_RULE),
            ("the same tokens under another cache_salt whose root collides, computed without "
             "reading the cache", twin_of_another_salt, SALT_TWIN_RULE),
            ("in flight after another's save: a lookup misses on a hash one request marked and "
             "another saved", marked_then_saved_by_another, IN_FLIGHT_RULE)):
        scenario(step, f"weak hash_fn: {name}{where}", rule=rule)(
            lambda cls, script=script, strategy=strategy: script(cls, strategy))


# ------------------------------------------------------------------ the chunk's start, the salt

CHUNK_RULE = ("a block saved at a chunk's start has the block before it as its parent (a chunk's "
              "start is not the chain's start): a lookup verifies each hit by its parent's lifetime")


@scenario(4, "a new Sequence after a prefill in 100-token chunks hits every full block", rule=CHUNK_RULE)
def chunked_then_hit(cls):
    cache = new_cache(cls)
    run_to_end(scheduler_for(cache, budget=100), new_seq(cache, prompt(), "first"))
    return match_of(cache, new_seq(cache, prompt(), "second"))


@scenario(4, "a new Sequence after a prefill in 16-token chunks (one block a step) hits every full block",
          rule=CHUNK_RULE + "; the second chunk starts at block 1, whose parent is block 0")
def block_chunked_then_hit(cls):
    cache = new_cache(cls)
    run_to_end(scheduler_for(cache, budget=BLOCK), new_seq(cache, prompt(), "first"))
    return match_of(cache, new_seq(cache, prompt(), "second"))


SALT_RULE = ("a saved block records the request's cache_salt, under the hash its salted chain gives "
             "it: a request with the same salt hits it")


def same_salt_again(cls, strategy):
    cache = new_cache(cls, strategy)
    run_to_end(scheduler_for(cache), new_seq(cache, prompt(), "first", salt="alice"))
    return match_of(cache, new_seq(cache, prompt(), "second", salt="alice"))


scenario(4, "a salted prompt seen before, looked up with the same cache_salt", rule=SALT_RULE)(
    lambda cls: same_salt_again(cls, "incremental"))
scenario(5, "a salted prompt seen before, looked up with the same cache_salt, under recompute",
         rule=SALT_RULE)(lambda cls: same_salt_again(cls, "recompute"))


# ------------------------------------------------------------------ step 3: in flight, at the edges

WAIT_BEHIND_COLLISION_RULE = ("when the lookup stops, it reports whether another running request is "
                              "computing that block, whatever the map holds under its hash (an entry that "
                              "fails _holds is no hit)")


@scenario(3, "weak hash_fn: a lookup misses on a collided entry while another request computes the block",
          rule=WAIT_BEHIND_COLLISION_RULE)
def in_flight_behind_collision(cls):
    """"c" is admitted and committed, its first chunk (8 tokens) leaving block 0 unwritten: both
    its blocks are in flight; "d" with c's tokens misses on a's block under block 0's hash."""
    cache, scheduler = weak_setup(cls, "incremental", budget=BLOCK // 2)
    scheduler.add(new_seq(cache, weak_tokens(10, 20, fill=3), "c"))
    scheduler.commit(scheduler.schedule())  # c admitted, tokens 0-7 computed: no block saved yet
    return match_of(cache, new_seq(cache, weak_tokens(10, 20, fill=3), "d"), "d's lookup")


@scenario(3, "weak hash_fn: in the same step's plan, a lookup misses on a collided entry an admission "
             "planned just before will compute", rule=WAIT_BEHIND_COLLISION_RULE + "; an admission "
             "planned earlier in the same step counts as computing it (plan_in_flight)")
def planned_behind_collision(cls):
    """"c" and "d" (the same tokens) are planned in one step: c's admission is planned first,
    then d's lookup runs against the plan's marks; nothing is committed."""
    cache, scheduler = weak_setup(cls, "incremental")
    c, d = (new_seq(cache, weak_tokens(10, 20, fill=3), name) for name in "cd")
    watched = {}
    inner = cache.lookup

    def lookup(seq):
        match = inner(seq)
        if seq is d:
            watched["next_in_flight of d's lookup"] = match.next_in_flight
            watched["cached tokens of d's lookup"] = match.num_cached_tokens
        return match
    cache.lookup = lookup
    scheduler.add(c)
    scheduler.add(d)
    plan = scheduler.schedule()
    return watched | {"requests the plan admits": [a.seq.request_id for a in plan.admissions]}


@scenario(3, "a prompt of exactly 32 full blocks while another request computes its last block",
          rule="only a block the lookup could serve is waited for: the block holding the last token "
               "is computed anyway (its logits are needed), so it is never a reason to wait")
def last_block_in_flight(cls):
    cache = new_cache(cls)
    scheduler = scheduler_for(cache, budget=500)  # "first" computes blocks 0 to 30, block 31 is in flight
    scheduler.add(new_seq(cache, prompt()[:32 * BLOCK], "first"))
    scheduler.commit(scheduler.schedule())
    return match_of(cache, new_seq(cache, prompt()[:32 * BLOCK], "second"))


@scenario(3, "weak hash_fn: block 0 seen before, block 1 collides (same hash, other tokens)",
          rule="every hit is verified with _holds, not only the first: a later block can collide under "
               "the chain's hash as well as block 0 can")
def later_block_collides(cls):
    cache, _ = weak_setup(cls, "incremental")
    tokens = weak_tokens(10, 20, fill=1)[:BLOCK] + weak_tokens(20, fill=9)
    return match_of(cache, new_seq(cache, tokens, "d"), "d's lookup")


@scenario(3, "weak hash_fn: block 0 collides (other tokens), block 1 holds the same tokens as before",
          rule="a prefix is served only if each of its blocks is a verified hit, from block 0 on: the "
               "lookup stops at the first block that fails _holds, whatever comes after it")
def first_block_collides(cls):
    cache, _ = weak_setup(cls, "incremental")
    tokens = [10] + [9] * (BLOCK - 1) + weak_tokens(20, fill=1)
    return match_of(cache, new_seq(cache, tokens, "d"), "d's lookup")


@scenario(3, "weak hash_fn: the same tokens under another cache_salt whose root collides",
          rule="a hit holds this sequence's tokens after the same parent under the same cache_salt "
               "(_holds): the tokens alone do not make a hit")
def salts_collide(cls):
    cache = new_cache(cls, hash_fn=first_token_hash)
    run_to_end(scheduler_for(cache), new_seq(cache, weak_tokens(10, 20, fill=1), "a", SALTS[0]))
    return match_of(cache, new_seq(cache, weak_tokens(10, 20, fill=1), "d", SALTS[1]), "d's lookup")


@scenario(5, "under recompute: a new Sequence after a prefill in 16-token chunks hits every full block",
          rule="at a chunk's start the 'before' chains the block from its parent block's hash, "
               "never from the chain's seed; the second chunk starts at block 1, whose parent is block 0")
def recompute_block_chunked_then_hit(cls):
    cache = new_cache(cls, "recompute")
    run_to_end(scheduler_for(cache, budget=BLOCK), new_seq(cache, prompt(), "first"))
    return match_of(cache, new_seq(cache, prompt(), "second"))


@scenario(5, "a prompt sharing the first 300 tokens of one seen before, under recompute",
          rule="the 'before' keeps no chain on the Sequence: it hashes each block it saves once more, "
               "chained from its parent block's hash")
def recompute_shared(cls):
    cache = new_cache(cls, "recompute")
    scheduler = scheduler_for(cache)
    run_to_end(scheduler, new_seq(cache, prompt(), "first"))
    seq = new_seq(cache, prompt()[:300] + list(range(7, 207)), "second")
    out = {"hash calls at save": run_to_end(scheduler, seq), "seq._block_hashes afterwards": len(seq._block_hashes)}
    return out | map_of(cache)


@scenario(5, "under recompute: a new Sequence after a prefill in 100-token chunks hits every full block",
          rule="at a chunk's start the 'before' chains the block from its parent block's hash, "
               "never from the chain's seed")
def recompute_chunked_then_hit(cls):
    cache = new_cache(cls, "recompute")
    run_to_end(scheduler_for(cache, budget=100), new_seq(cache, prompt(), "first"))
    return match_of(cache, new_seq(cache, prompt(), "second"))


@scenario(3, "a Sequence with 21 generated tokens looked up again (as after a preemption)",
          rule="a lookup reads all of the sequence's tokens, generated ones too: they are what it "
               "queries, and their full blocks are part of its chain")
def lookup_after_generated(cls):
    cache = new_cache(cls)
    run_to_end(scheduler_for(cache), new_seq(cache, prompt(), "first"))
    seq = new_seq(cache, prompt(), "preempted")
    for token in range(21):  # sampled before the preemption: 548 tokens, 34 full blocks
        seq.append_token(token)
    return match_of(cache, seq)
