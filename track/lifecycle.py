"""The track's scenarios for a sequence's whole life: decode, preemption and re-admission as the
same ``Sequence``, a twin's freed duplicate, and the "before" at and beside block multiples.

A scenario here drives the scheduler as the engine does, without a model (``serve``): each step
is planned, then committed, and a sequence whose chunk reached its last token gets one
"sampled" token (any id will do: nothing reads K/V) or finishes at its ``max_tokens``. A small
pool makes a decode token preempt the most recently admitted request, so it comes back as the
same object, its chain already on it, and its lookup, its re-prefill and its saves run again.
Each scenario names the rule a failure breaks; steps 3, 4 and 5 run them under the strategy
they check.
"""
from __future__ import annotations

from block_manager import Block
from prefix_cache import PrefixCache
from scheduler import Scheduler, Sequence
from track.checks import (Chain, calls, entries, new_cache, new_seq, prompt, run_to_end, scenario,
                          scheduler_for)

SMALL = 4  # tokens per block in the preemption scenarios: a few blocks make a full pool


def sampled(seq: Sequence) -> int:
    """The "sampled" token: a fixed function of the request and the position (no model)."""
    return 1000 + (31 * seq.num_tokens + 7 * len(seq.request_id)) % 997


class Watch:
    """The hash calls, cached tokens and stop of every lookup of one sequence (the scheduler's
    calls through ``lookup``, counted around them: your code may trace nothing)."""

    def __init__(self, cache: PrefixCache, seq: Sequence) -> None:
        self.calls: list[int] = []
        self.cached: list[int] = []
        self.named: list[int] = []
        self.stops: list[str] = []
        inner = cache.lookup

        def lookup(s: Sequence):
            before = cache.hash_computations
            match = inner(s)
            if s is seq:
                self.calls.append(cache.hash_computations - before)
                self.cached.append(match.num_cached_tokens)
                self.named.append(len(match.chain))
                self.stops.append(str(cache.stop_of(s)))
            return match
        cache.lookup = lookup  # this cache only: the scheduler calls it through the instance


def serve(scheduler: Scheduler, *seqs: Sequence, limit: int = 2000) -> int:
    """Run ``seqs`` to the end as the engine would, minus the forward. Returns the hash calls
    made while committing (the saves)."""
    cache, at_save = scheduler.prefix_cache, 0
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(limit):
        if not scheduler.has_unfinished:
            return at_save
        plan = scheduler.schedule()
        if not plan:
            raise RuntimeError("the scheduler made no progress (a lookup that always says 'in flight'?)")
        at_save += calls(cache, lambda: scheduler.commit(plan))
        for chunk in plan:
            seq = chunk.seq
            if chunk.completes_sequence and seq in scheduler.running:
                seq.append_token(sampled(seq))
                if seq.num_output_tokens >= seq.max_tokens:
                    scheduler.finish(seq, "length")
    raise RuntimeError(f"not finished after {limit} steps")


def ids(n: int, first: int) -> list[int]:
    """``n`` token ids from the demo prompt, from position ``first`` on."""
    return prompt()[first:first + n]


def the_map(cache: PrefixCache) -> dict:
    return {"the map: cached block ids": [b.block_id for _, b in entries(cache)],
            "the map: hashes, by block id": Chain(h for h, _ in entries(cache))}


def life(cache: PrefixCache, scheduler: Scheduler, watched: Sequence, *seqs: Sequence) -> dict:
    """Serve ``seqs`` (``watched`` among them) and say what happened to ``watched`` and the cache."""
    watch = Watch(cache, watched)
    out = {}
    out["hash calls in all"] = calls(cache, lambda: out.setdefault("hash calls at save", serve(scheduler, *seqs)))
    out["preemptions"] = scheduler.stats.preemptions
    out[f"hash calls of each lookup of {watched.request_id}"] = watch.calls
    out[f"cached tokens at each lookup of {watched.request_id}"] = watch.cached
    out[f"blocks each lookup of {watched.request_id} names in its chain"] = watch.named
    out[f"why each lookup of {watched.request_id} stopped"] = watch.stops
    out[f"{watched.request_id}'s chain afterwards"] = Chain(watched._block_hashes)
    out["evictions"] = cache.num_evictions
    out["tokens served from cache"] = scheduler.stats.prefix_cache_hits
    return out | the_map(cache)


# ------------------------------------------------------------------ preempted during decode

def preempted_in_decode(cls, strategy: str) -> dict:
    """Two requests (50 and 49 prompt tokens) decode 24 tokens each in a pool of 32 blocks of 4:
    the second is preempted while decoding, just after its last sampled token filled a block
    (so that block is full but was never computed), waits (its lookups hit what is left of its
    own cached blocks), and comes back as the same Sequence, generated tokens and chain included."""
    cache = new_cache(cls, strategy, pool=32, block=SMALL)
    scheduler = scheduler_for(cache)
    first = new_seq(cache, ids(50, 0), "first", max_tokens=24)
    second = new_seq(cache, ids(49, 100), "second", max_tokens=24)
    return life(cache, scheduler, second, first, second)


READMIT_RULE = ("a Sequence that comes back after a preemption is the same object, its chain already on "
                "it: its lookups hash only blocks not hashed yet (the 'before' rebuilds the chain at each "
                "one), its re-prefill saves under the hashes it has, and it is served its own cached "
                "blocks, generated ones too")

scenario(3, "a Sequence preempted during decode, looked up again until it is re-admitted",
         rule=READMIT_RULE)(lambda cls: preempted_in_decode(cls, "incremental"))
scenario(4, "a Sequence preempted during decode, re-admitted and re-prefilled (its chain filled)",
         rule=READMIT_RULE)(lambda cls: preempted_in_decode(cls, "incremental"))
scenario(5, "a Sequence preempted during decode, re-admitted and re-prefilled, under recompute",
         rule=READMIT_RULE)(lambda cls: preempted_in_decode(cls, "recompute"))


# ------------------------------------------------------------------ preempted in the middle of a chunked prefill

def preempted_mid_prefill(cls, strategy: str, first_tokens: int) -> dict:
    """"first" (7 tokens) decodes ``first_tokens`` tokens; "long" (30 tokens) is prefilled in
    chunks beside it and is preempted after its second chunk (tokens 0-9: blocks 0 and 1 saved,
    block 2 half written), when first's decode needs a block of the full pool (10 blocks of 4).
    While long waits, first takes free blocks; with 29 new tokens it takes long's cached block 1
    too (evicted), so long's re-prefill starts at block 1, not 2."""
    cache = new_cache(cls, strategy, pool=10, block=SMALL)
    scheduler = scheduler_for(cache, budget=9)
    first = new_seq(cache, ids(7, 200), "first", max_tokens=first_tokens)
    long = new_seq(cache, ids(30, 300), "long", max_tokens=2)
    out = life(cache, scheduler, long, first, long)
    again = new_seq(cache, ids(30, 300), "again")  # a new request with long's prompt: what was saved?
    return out | {f"a new Sequence's {k}": v for k, v in match_brief(cache, again).items()}


def match_brief(cache: PrefixCache, seq: Sequence) -> dict:
    match = cache.lookup(seq)
    return {"cached tokens": match.num_cached_tokens, "cached block ids": [b.block_id for b in match.blocks]}


CHUNK_PREEMPT_RULE = ("a chunk's first block has the block before it in the sequence's block table as its "
                      "parent, read at every chunk: after a preemption the re-prefill starts where its lookup "
                      "stopped, which is not where its last chunk before the preemption ended (nothing about "
                      "a chunk's parent is remembered across calls)")

for step, strategy in ((4, "incremental"), (5, "recompute")):
    where = "" if step == 4 else ", under recompute"
    scenario(step, f"a Sequence preempted in the middle of a chunked prefill, re-admitted on its own "
                   f"cached blocks{where}", rule=CHUNK_PREEMPT_RULE)(
        lambda cls, strategy=strategy: preempted_mid_prefill(cls, strategy, first_tokens=8))
    scenario(step, f"a Sequence preempted in the middle of a chunked prefill, one of its cached blocks "
                   f"evicted while it waits{where}", rule=CHUNK_PREEMPT_RULE)(
        lambda cls, strategy=strategy: preempted_mid_prefill(cls, strategy, first_tokens=29))


# ------------------------------------------------------------------ a twin's freed duplicate

def free_queue(block_manager) -> list[int]:
    """The free queue's block ids, front (reused first) to back."""
    out, block = [], block_manager.free_queue.head
    while block is not None:
        out.append(block.block_id)
        block = block.next
    return out


def twin_duplicates(cls, strategy: str, copies_in_one_step: bool) -> dict:
    """The 527-token prompt computed twice (one after the other, the second without reading the
    cache; or two copies in one step), in a pool of 70 blocks: the twins' own copies are freed.
    Then a request of 500 other tokens needs 32 blocks: which blocks it gets, and what is evicted."""
    cache = new_cache(cls, strategy, pool=70)
    scheduler = scheduler_for(cache)
    if copies_in_one_step:
        run_to_end(scheduler, new_seq(cache, prompt(), "copy-1"), new_seq(cache, prompt(), "copy-2"))
    else:
        run_to_end(scheduler, new_seq(cache, prompt(), "first"))
        run_to_end(scheduler, new_seq(cache, prompt(), "again", reads_prefix_cache=False))
    blocks: list[Block] = cache.block_manager.blocks
    out = {"blocks that carry a hash": sum(b.block_hash is not None for b in blocks),
           "cache entries": cache.num_cached_blocks,
           "free blocks that carry no hash": sum(b.state == "free" for b in blocks),
           "the free queue, front to back": free_queue(cache.block_manager)}
    other = new_seq(cache, list(range(3, 503)), "other")
    run_to_end(scheduler, other)
    return out | {"evictions after the other request": cache.num_evictions,
                  "cache entries after it": cache.num_cached_blocks,
                  "the free queue after it": free_queue(cache.block_manager)}


TWIN_FREE_RULE = ("a block switched to its cached twin is freed as a plain block: it carries no hash (only a "
                  "block in the map does), so it is reused first and its reuse evicts nothing")

for step, strategy in ((4, "incremental"), (5, "recompute")):
    where = "" if step == 4 else ", under recompute"
    scenario(step, f"a twin's freed copy: what it carries, and what reusing it evicts{where}",
             rule=TWIN_FREE_RULE)(lambda cls, strategy=strategy: twin_duplicates(cls, strategy, False))
    scenario(step, f"two copies in one step: the second's freed copies, and what reusing them evicts{where}",
             rule=TWIN_FREE_RULE)(lambda cls, strategy=strategy: twin_duplicates(cls, strategy, True))


# ------------------------------------------------------------------ the "before" at and beside block multiples

def table_at(cls, strategy: str, length: int) -> dict:
    """A cold request of ``length`` tokens (the prompt's first), then the same prompt as a new
    Sequence, then that Sequence looked up again: the hash calls of each, the chains, the map."""
    cache = new_cache(cls, strategy)
    scheduler = scheduler_for(cache)
    tokens = prompt()[:length]
    cold = new_seq(cache, tokens, "cold")
    out = {}
    out["cold request: hash calls"] = calls(cache, lambda: out.setdefault(
        "cold request: hash calls at save", run_to_end(scheduler, cold)))
    new = new_seq(cache, tokens, "new")
    out["new Sequence: hash calls"] = calls(cache, lambda: out.setdefault(
        "new Sequence: hash calls at save", run_to_end(scheduler, new)))
    out["the same Sequence looked up again: hash calls"] = calls(cache, lambda: cache.lookup(new))
    match = cache.lookup(new)
    out["the chain a lookup returns"] = Chain(match.chain)
    out["cached tokens"] = match.num_cached_tokens
    return out | the_map(cache)


MULTIPLE_RULE = ("a chain covers every full block, the last one too when the length is an exact multiple "
                 "of block_size (it is hashed and saved though never served: it holds the last token)")

for length in (512, 511, 513):
    how = {512: "exactly 32 full blocks", 511: "one token short of 32 blocks", 513: "one token past 32 blocks"}[length]
    scenario(5, f"the table's rows, under recompute, for a prompt of {length} tokens ({how})",
             rule=MULTIPLE_RULE)(lambda cls, length=length: table_at(cls, "recompute", length))
scenario(4, "the table's rows for a prompt of 512 tokens (exactly 32 full blocks)",
         rule=MULTIPLE_RULE)(lambda cls: table_at(cls, "incremental", 512))


def rebuild_at(cls, length: int) -> dict:
    cache = new_cache(cls, "recompute")
    seq = new_seq(cache, prompt()[:length], "a")
    out = {}
    out["hash calls"] = calls(cache, lambda: out.setdefault("the chain", Chain(cache._rebuild_chain(seq))))
    return out


scenario(5, "_rebuild_chain of exactly 32 full blocks, and of 16 tokens (one full block)",
         rule=MULTIPLE_RULE)(lambda cls: {f"{n} tokens: {k}": v for n in (512, 16)
                                          for k, v in rebuild_at(cls, n).items()})


# ------------------------------------------------------------------ a commit runs no hash function

def hashes_in_commits(cls, strategy: str) -> dict:
    """The 527-token prompt prefilled in 100-token chunks, then 40 tokens decoded, with the
    cache's ``hash_fn`` counting its calls made by the saves of a step's commit (where a swapped
    hash_fn that raises would leave the step half applied)."""
    cache = new_cache(cls, strategy)
    scheduler = scheduler_for(cache, budget=100)
    inside, counts = [False], {"by the saves": 0, "in all": 0}
    real = cache.hash_fn

    def hash_fn(data: bytes, seed: int) -> int:
        counts["in all"] += 1
        counts["by the saves"] += inside[0]
        return real(data, seed)
    cache.hash_fn = hash_fn
    saves = cache.cache_blocks

    def watched(seq, start, end):
        inside[0] = True
        try:
            return saves(seq, start, end)
        finally:
            inside[0] = False
    cache.cache_blocks = watched  # the commit's saves: after prepare_saves hashed what they need
    seq = new_seq(cache, prompt(), "a", max_tokens=40)
    serve(scheduler, seq)
    return {f"hash_fn calls {k}": v for k, v in counts.items()} | the_map(cache)


AHEAD_RULE = ("a commit runs no hash function: every hash a save needs was computed just before the commit "
              "(prepare_saves), and _chain_hash takes it from self._ahead")

scenario(4, "hash_fn calls made by a commit's saves (chunked prefill, then decode)", rule=AHEAD_RULE)(
    lambda cls: hashes_in_commits(cls, "incremental"))
scenario(5, "hash_fn calls made by a commit's saves (chunked prefill, then decode), under recompute",
         rule=AHEAD_RULE)(lambda cls: hashes_in_commits(cls, "recompute"))
