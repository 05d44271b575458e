"""Every miss explained: a lookup that stops records why, per request. For each reason
(prefix_cache.MissReason) a real engine is driven into it, and the reason is on the lookup's
"miss" event and in the request's output beside ``num_cached_tokens`` (``cache_miss_reason``),
with its details: when and for whom a block was evicted, where a collision's tokens differ,
how long a request waited. Finding a reason computes no hash. ``python run.py --chain`` and the
step page print the same reasons (tests/test_chain_demo.py, tests/test_step_page.py)."""
from __future__ import annotations

import pickle

import pytest

import prefix_cache
from block_manager import BlockManager
from engine import LLM, SamplingParams
from prefix_cache import CacheMiss, MissReason, NoPrefixCache, PrefixCache
from scheduler import Sequence

BS = 4
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def engine(llama_dir: str, **kw) -> LLM:
    return LLM(llama_dir, block_size=BS, device="cpu", dtype="float32", enforce_eager=True,
               **{"num_kv_blocks": 64, "max_num_seqs": 4} | kw)


def send(llm: LLM, *prompts, params: SamplingParams = ONE, salt: str | None = None):
    items = [dict(prompt_token_ids=list(p)) | ({"cache_salt": salt} if salt else {}) for p in prompts]
    return llm.generate(items, params, use_tqdm=False)


def weak(data: bytes, seed: int) -> int:
    """Collides on purpose: a block's first token id plus the seed."""
    return (int.from_bytes(data[:8], "little") + seed) % 2 ** 64


P = list(range(100, 122))  # 22 tokens: 5 full blocks of 4 and 2 more


# Each case: (setup and final request) -> that request's output. The output is the last one sent.
def never_saved(llm):
    return send(llm, P)[0]


def evicted(llm):
    send(llm, P)                                  # 6 blocks: 5 cached
    send(llm, list(range(300, 300 + 4 * 14)))     # needs 14 of the 16: evicts P's blocks 4, 3, 2
    return send(llm, P)[0]


def collision(llm):
    llm.prefix_cache.hash_fn = weak
    send(llm, [10, 1, 1, 1, 20, 1, 1, 1, 5])
    return send(llm, [10, 1, 2, 1, 20, 1, 1, 1, 5])[0]  # block 0 differs at position 2


def other_parent(llm):
    send(llm, P)
    cache = llm.prefix_cache
    block0 = cache.entries[next(h for h, b in cache.entries.items() if b.parent is None)]
    cache.evict(block0)   # as if block 0 alone was reused: block 1's entry stays, after its old parent
    send(llm, P[:4] + [7, 7, 7, 7, 7])  # block 0 computed and saved again, in a new lifetime
    return send(llm, P)[0]


def other_salt(llm):
    send(llm, P)
    return send(llm, P, salt="alice")[0]


def partial_block(llm):
    return send(llm, P[:3])[0]  # shorter than a block: 0 % hits


def last_token(llm):
    send(llm, P[:20])
    return send(llm, P[:20])[0]  # 5 full blocks: block 4 holds the last token


def in_flight(llm):
    return send(llm, P, P)[1]  # the second copy waits a step for the first's blocks


def not_read(llm):
    send(llm, P)
    return send(llm, P, params=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]


def caching_off(llm):
    send(llm, P)
    return send(llm, P)[0]


CASES = {MissReason.NEVER_SAVED: (never_saved, {}, 0),
         MissReason.EVICTED: (evicted, dict(num_kv_blocks=16), 8),
         MissReason.COLLISION: (collision, {}, 0),
         MissReason.OTHER_PARENT: (other_parent, {}, 4),
         MissReason.OTHER_SALT: (other_salt, {}, 0),
         MissReason.PARTIAL_BLOCK: (partial_block, {}, 0),
         MissReason.LAST_TOKEN: (last_token, {}, 16),
         MissReason.IN_FLIGHT: (in_flight, {}, 20),
         MissReason.NOT_READ: (not_read, {}, 0),
         MissReason.CACHING_OFF: (caching_off, dict(enable_prefix_caching=False), 0)}


def test_every_reason_has_a_case():
    assert set(CASES) == set(MissReason)


PATHS = {"plain": dict(fast_paths=False), "fast": {}, "int8": dict(quantization="int8")}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("reason", list(MissReason), ids=[r.name for r in MissReason])
def test_each_reason_is_on_the_miss_event_and_in_the_output(llama_dir, reason, path):
    case, kw, cached = CASES[reason]
    llm = engine(llama_dir, **kw, **PATHS[path])
    with llm.prefix_cache.recording() as events:
        out = case(llm)
    why = out.cache_miss_reason
    assert isinstance(why, CacheMiss) and isinstance(why, str) and out.num_cached_tokens == cached
    misses = [e for e in events if e.kind == "miss" and e.request_id == out.request_id]
    if reason is MissReason.CACHING_OFF:
        assert why.reason is reason and not misses  # nothing is looked up
        return
    if reason is MissReason.IN_FLIGHT:  # admitted one step later: it says it waited, and why
        assert [m.reason.reason for m in misses] == [MissReason.IN_FLIGHT, MissReason.PARTIAL_BLOCK]
        assert why.reason is MissReason.PARTIAL_BLOCK and why.waited == 1
        assert "after waiting 1 step for block 0" in why and "is computing it" in misses[0].reason
        assert [e.kind for e in events if e.request_id == out.request_id and e.kind in ("miss", "wait")] == \
            ["miss", "wait", "miss"]
        return
    assert why.reason is reason, why
    assert misses and misses[-1].reason == why and misses[-1].reason.reason is reason
    assert misses[-1].index == why.block


def test_the_details_each_reason_gives(llama_dir):
    """When and for whom a block was evicted; where a collision's tokens differ; the partial tail."""
    llm = engine(llama_dir, num_kv_blocks=16)
    why = evicted(llm).cache_miss_reason
    assert why.block == 2 and "the cache's eviction 3: pool block 2 reused for request '1'" in why
    why = collision(engine(llama_dir)).cache_miss_reason
    assert why.block == 0 and why.position == 2 and "first differ at token position 2" in why
    why = partial_block(engine(llama_dir)).cache_miss_reason
    assert why.block == 0 and "tokens 0-2 are a partial block" in why
    why = last_token(engine(llama_dir)).cache_miss_reason
    assert why.block == 4 and "the last token (position 19)" in why
    why = other_parent(engine(llama_dir)).cache_miss_reason
    assert why.block == 1 and "another parent block" in why


def test_finding_a_reason_hashes_nothing():
    """The reason is read off the match and the maps: a second lookup of the same Sequence, which
    hashes nothing, still says why it stopped."""
    cache = PrefixCache(BlockManager(8, BS))
    seq = Sequence(list(range(10)), 1)
    first = cache.lookup(seq)
    before = cache.hash_computations
    cache.lookup(seq)
    assert cache.hash_computations == before and first.num_cached_tokens == 0
    assert cache.stop_of(seq).reason is MissReason.NEVER_SAVED


def test_a_salted_miss_under_a_colliding_root_names_the_salt():
    """Two salts whose roots collide under a weak hash: the entry holds the same tokens, another salt."""
    cache = PrefixCache(BlockManager(16, BS))
    cache.hash_fn = lambda data, seed: (int.from_bytes(data[:8], "little") + seed) % 2 ** 64
    a = Sequence([10, 1, 1, 1, 5], 1, cache_salt="tenant-A-1", root_hash=cache.root_hash("tenant-A-1"))
    a.block_table = [cache.block_manager.allocate().block_id for _ in range(2)]
    cache.lookup(a)
    cache.cache_blocks(a, 0, 5)
    b = Sequence([10, 1, 1, 1, 5], 1, cache_salt="tenant-A-2", root_hash=cache.root_hash("tenant-A-2"))
    assert cache.root_hash("tenant-A-1") == cache.root_hash("tenant-A-2")
    cache.lookup(b)
    assert cache.stop_of(b).reason is MissReason.OTHER_SALT


def test_old_evictions_are_forgotten_and_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(prefix_cache, "EVICTIONS_REMEMBERED", 2)
    cache = PrefixCache(BlockManager(4, BS))
    seqs = [Sequence(list(range(10 * i, 10 * i + 5)), 1, request_id=str(i)) for i in range(4)]
    for seq in seqs:  # each saves its block 0, then it is evicted
        seq.block_table = [cache.block_manager.allocate().block_id]
        cache.lookup(seq)
        cache.cache_blocks(seq, 0, 4)
        cache.block_manager.release(seq.block_table)
        cache.evict(cache.block_manager.blocks[seq.block_table[0]])
    again = Sequence(list(range(0, 5)), 1)
    cache.lookup(again)
    assert cache.stop_of(again).reason is MissReason.NEVER_SAVED
    assert "or evicted before the last 2 evictions" in cache.stop_of(again)
    last = Sequence(list(range(30, 35)), 1)
    cache.lookup(last)
    assert cache.stop_of(last).reason is MissReason.EVICTED


def test_a_reason_survives_pickling_and_the_cache_off_has_one():
    why = CacheMiss(MissReason.COLLISION, 3, "block 3: ...", position=13, waited=1)
    back = pickle.loads(pickle.dumps(why))
    assert (back, back.reason, back.block, back.position, back.waited) == (why, why.reason, 3, 13, 1)
    off = NoPrefixCache(BlockManager(2, BS))
    assert off.stop_of(Sequence([1, 2, 3], 1)).reason is MissReason.CACHING_OFF


def test_a_commits_saves_call_no_hash_function():
    """prepare_saves hashes ahead what the saves need, keyed by the block and its parent's hash,
    so a commit's saves never call hash_fn (a swapped one that raises cannot stop a commit half
    way) -- under both strategies, over chunked prefill and decode."""
    from track.lifecycle import hashes_in_commits
    for strategy in ("incremental", "recompute"):
        counts = hashes_in_commits(PrefixCache, strategy)
        assert counts["hash_fn calls by the saves"] == 0 < counts["hash_fn calls in all"], strategy


def test_a_miss_reason_never_tells_one_salt_what_another_cached(llama_dir):
    """The salt keeps tenants apart, and so do the reasons: a salted request is told the same
    whether or not another salt (or no salt) cached its tokens, and an unsalted request whose
    tokens only a salted one cached is told "never saved", as if nobody had."""
    llm = engine(llama_dir)
    other = list(range(200, 222))
    send(llm, P, salt="bob")                       # bob caches P
    told_alice = send(llm, P, salt="alice")[0].cache_miss_reason
    fresh = send(llm, other, salt="alice")[0].cache_miss_reason  # nobody cached `other`
    assert told_alice.reason is fresh.reason is MissReason.OTHER_SALT
    assert str(told_alice) == str(fresh)
    unsalted = send(llm, P)[0].cache_miss_reason
    assert unsalted.reason is MissReason.NEVER_SAVED and "bob" not in str(unsalted)
