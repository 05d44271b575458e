"""The chapter's table as assertions, and the prefix-cache reuse bugs public engines shipped.

Table rows use the chapter's numbers: a 4096-token prompt, block_size 16, N = 256 blocks,
a pool large enough that nothing is evicted.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import Sequence
from helpers import assert_no_leak, drain, greedy, make_llm, random_prompt

PROMPT_LEN, BLOCK = 4096, 16
N = PROMPT_LEN // BLOCK


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    return random_prompt(PROMPT_LEN, seed=7)


def chapter_llm(path, strategy="incremental", **kw):
    return make_llm(path, block_size=BLOCK, num_kv_blocks=2 * N + 8, hash_strategy=strategy, **kw)


def lookup(llm, seq):
    return llm.prefix_cache._lookup_prefix_cache(seq)


def hashes_during(llm, fn):
    before = llm.stats()["hash_computations"]
    result = fn()
    return llm.stats()["hash_computations"] - before, result


# ---------------------------------------------------------------- the chapter's table

@pytest.mark.parametrize("strategy, expected", [("recompute", 2 * N), ("incremental", N)])
def test_cold_request_hash_count(long_ckpt, long_prompt, strategy, expected):
    llm = chapter_llm(long_ckpt, strategy)
    calls, _ = hashes_during(llm, lambda: llm.generate([long_prompt], greedy(1), use_tqdm=False))
    assert calls == expected
    assert llm.stats()["blocks_cached"] == N
    assert_no_leak(llm)


@pytest.mark.parametrize("strategy, expected", [("recompute", N), ("incremental", 0)])
def test_same_sequence_looked_up_again(long_ckpt, long_prompt, strategy, expected):
    """As on re-admission after preemption, or a retry because blocks were short."""
    llm = chapter_llm(long_ckpt, strategy)
    seq = Sequence(long_prompt)
    first, _ = hashes_during(llm, lambda: lookup(llm, seq))
    again, result = hashes_during(llm, lambda: lookup(llm, seq))
    assert first == N
    assert again == expected
    assert result.blocks == [] and result.num_cached_tokens == 0  # nothing cached yet
    assert len(result.chain) == N
    if strategy == "incremental":
        assert len(seq._block_hashes) == N and seq._prev_hash == seq._block_hashes[-1]


@pytest.mark.parametrize("strategy, expected", [("recompute", N), ("incremental", 0)])
def test_saving_during_prefill(long_ckpt, long_prompt, strategy, expected, monkeypatch):
    """Hash calls made while saving a cold request's blocks, over a chunked prefill: the
    "before" hashes every block again; incremental reuses the hash the lookup stored."""
    llm = chapter_llm(long_ckpt, strategy, max_num_batched_tokens=1024)
    pc, saving = llm.prefix_cache, []
    real = pc._do_prefill_step

    def counted(*args):
        calls, result = hashes_during(llm, lambda: real(*args))
        saving.append(calls)
        return result
    monkeypatch.setattr(pc, "_do_prefill_step", counted)
    llm.generate([long_prompt], greedy(1), use_tqdm=False)
    assert sum(saving) == expected
    assert llm.stats()["blocks_cached"] == N


def test_new_sequence_same_prompt_hashes_once_and_hits(long_ckpt, long_prompt):
    """The chapter's "0" holds for the same Sequence object. A new Sequence with the same
    prompt (a new request) must hash its N blocks once; then all but the last block is cached."""
    llm = chapter_llm(long_ckpt)
    params = greedy(2)
    first = llm.generate([long_prompt], params, use_tqdm=False)[0]
    before = llm.stats()
    calls, second = hashes_during(llm, lambda: llm.generate([long_prompt], params, use_tqdm=False)[0])
    after = llm.stats()
    assert calls == N
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == PROMPT_LEN - BLOCK
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == BLOCK
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == PROMPT_LEN - BLOCK
    assert second.token_ids == first.token_ids
    assert_no_leak(llm)


def test_tokens_identical_off_recompute_incremental(long_ckpt, long_prompt):
    params = greedy(4)
    runs = {}
    for name, kw in {"off": dict(enable_prefix_caching=False), "recompute": dict(strategy="recompute"),
                     "incremental": dict()}.items():
        llm = chapter_llm(long_ckpt, **kw)
        runs[name] = [o.token_ids for o in llm.generate([long_prompt, long_prompt[:1000]], params, use_tqdm=False)]
        assert_no_leak(llm)
    assert runs["off"] == runs["recompute"] == runs["incremental"]
    assert llm.stats()["hash_computations"] > 0


# ---------------------------------------------------------------- correct reuse


@pytest.mark.parametrize("length", [64, 70])
def test_fully_cached_prompt_still_computes_last_token(llama_dir, reference, length):
    llm = make_llm(llama_dir, block_size=BLOCK)
    prompt = random_prompt(length, seed=length)
    params = greedy(6)
    first = llm.generate([prompt], params, use_tqdm=False)
    before = llm.stats()["prompt_tokens_computed"]
    second = llm.generate([prompt], params, use_tqdm=False)
    computed = llm.stats()["prompt_tokens_computed"] - before
    assert computed == (BLOCK if length % BLOCK == 0 else length % BLOCK)
    reference.compare_all([prompt, prompt], first + second, 6)
    assert_no_leak(llm)


@pytest.mark.parametrize("strategy", ["incremental", "recompute"])
def test_same_prompt_same_step_waits_for_the_written_prefix(llama_dir, reference, strategy):
    """The second copy sees the first one's blocks in flight and waits one step, then is
    served from cache instead of computing the same blocks again (both strategies: the
    wait is not a matter of how hashes are obtained)."""
    llm = make_llm(llama_dir, block_size=8, hash_strategy=strategy)
    prompt = random_prompt(40, seed=3)
    params = greedy(5)
    a, b = llm.add_request(prompt, params), llm.add_request(prompt, params)
    llm.step()
    assert len(llm.scheduler.running) == 1 and len(llm.scheduler.waiting) == 1
    assert llm.stats()["prefix_cache_hits"] == 0
    llm.step()
    assert llm.stats()["prefix_cache_hits"] == 32  # all but the last block (the last-token rule)
    assert llm.stats()["prompt_tokens_computed"] == 40 + 8
    # The recomputed last block is identical to the first copy's: folded into it, not duplicated.
    first, second = llm.scheduler.running
    assert first.block_table[:5] == second.block_table[:5]
    assert all(llm.block_manager.blocks[i].ref_count == 2 for i in first.block_table[:5])
    assert llm.stats()["blocks_cached"] == 5
    outs = drain(llm)
    reference.compare_all([prompt, prompt], [outs[a], outs[b]], 5)
    assert_no_leak(llm)


@pytest.mark.parametrize("strategy", ["incremental", "recompute"])
def test_recomputed_cached_prefix_is_folded_block_by_block(llama_dir, reference, strategy):
    """A request that must compute a prompt that is already cached (prompt logprobs skip cache
    reads) folds every block it completes into the cached twin, each one chained from the
    twin before it: no private copies are left, the map is never overwritten."""
    llm = make_llm(llama_dir, block_size=8, hash_strategy=strategy)
    prompt = random_prompt(44, seed=12)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    cached = dict(llm.prefix_cache.entries)
    assert len(cached) == 5
    rid = llm.add_request(prompt, greedy(3, prompt_logprobs=1))
    llm.step()  # the whole prompt in one chunk
    (seq,) = llm.scheduler.running
    assert seq.block_table[:5] == [cached[h].block_id for h in cached]
    assert dict(llm.prefix_cache.entries) == cached
    outs = drain(llm)  # checks the block accounting after every step
    reference.compare_all([prompt], [outs[rid]], 3)
    assert_no_leak(llm)


def test_preempted_sequence_hits_its_own_cached_blocks(llama_dir, reference):
    prompts = [random_prompt(48 + 8 * i, seed=100 + i) for i in range(4)]  # distinct: hits are own blocks
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=20, max_num_batched_tokens=64)
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    reference.compare_all(prompts, outs, 40)
    assert_no_leak(llm)


def test_chunk_starting_at_cached_offset_sees_whole_context(llama_dir, reference):
    base = random_prompt(64, seed=5)
    extended = base + random_prompt(45, seed=6)
    llm = make_llm(llama_dir, block_size=16, max_num_batched_tokens=16)
    params = greedy(8, logprobs=3)
    llm.generate([base], params, use_tqdm=False)
    out = llm.generate([extended], params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == 64  # the extension starts at a cached offset
    reference.compare_all([extended], out, 8)
    cold = make_llm(llama_dir, block_size=16, enable_prefix_caching=False).generate([extended], params, use_tqdm=False)
    for ours, ref in zip(out[0].logprobs, cold[0].logprobs):
        common = ours.keys() & ref.keys()
        assert common and all(abs(ours[t] - ref[t]) < 1e-4 for t in common)


def test_evicted_block_never_returned_for_old_hash(llama_dir, reference):
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=12)
    params = greedy(2)
    old = random_prompt(64, seed=11)
    llm.generate([old], params, use_tqdm=False)
    old_seq = Sequence(old)
    lookup(llm, old_seq)
    old_hashes = list(lookup(llm, old_seq).chain)
    others = [random_prompt(60, seed=20 + i) for i in range(3)]
    llm.generate(others, params, use_tqdm=False)
    assert llm.stats()["evictions"] > 0
    for i, h in enumerate(old_hashes):
        block = llm.prefix_cache.entries.get(h)
        assert block is None or block.token_bytes == old_seq.block_bytes(i, 8)
    for i, block in enumerate(lookup(llm, Sequence(old)).blocks):
        assert block.token_bytes == old_seq.block_bytes(i, 8)
    again = llm.generate([old], params, use_tqdm=False)
    reference.compare_all([old], again, 2)
    assert_no_leak(llm)


def test_weak_hash_collisions_cost_a_miss_never_a_wrong_token(llama_dir, reference):
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=40, max_num_batched_tokens=32)
    llm.prefix_cache.hash_fn = lambda data, seed: (seed + data[0]) % 3  # three hash values for everything
    prefix = random_prompt(24, seed=1)
    prompts = [prefix + random_prompt(9 + 5 * i, seed=30 + i) for i in range(4)]
    prompts += [random_prompt(33, seed=40 + i) for i in range(3)]
    params = greedy(8)
    outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > 0  # verified hits still happen
    reference.compare_all(prompts + prompts, outs, 8)
    assert_no_leak(llm)


def test_cache_salt_separates_tenants(llama_dir):
    """vLLM-style prompt dicts with a ``cache_salt``: only equal salts share blocks."""
    llm = make_llm(llama_dir, block_size=8)
    prompt = random_prompt(40, seed=9)
    run = lambda salt: llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}],
                                    greedy(3), use_tqdm=False)
    hits = lambda: llm.stats()["prefix_cache_hits"]
    first = run("alice")
    run("bob")
    assert hits() == 0
    run(None)
    assert hits() == 0
    again = run("alice")
    assert hits() == 32
    assert again[0].token_ids == first[0].token_ids
    assert_no_leak(llm)


# ---------------------------------------------------------------- eviction

def test_free_keeps_hash_and_evicts_tail_first(llama_dir):
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=10)
    params = greedy(1)
    a = random_prompt(48, seed=50)  # 6 full blocks, all cached after it finishes
    llm.generate([a], params, use_tqdm=False)
    assert llm.stats()["blocks_in_use"] == 0 and llm.stats()["blocks_cached"] == 6
    # 6 blocks needed, 4 never-cached blocks free: the 2 tail blocks of `a` are evicted.
    llm.generate([random_prompt(47, seed=51)], params, use_tqdm=False)
    assert llm.stats()["evictions"] == 2
    assert lookup(llm, Sequence(a)).num_cached_tokens == 4 * 8  # the shared head survived


def test_lru_order_across_requests(llama_dir):
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=8)
    params = greedy(1)
    older, newer = random_prompt(24, seed=60), random_prompt(24, seed=61)
    llm.generate([older], params, use_tqdm=False)
    llm.generate([newer], params, use_tqdm=False)
    llm.generate([random_prompt(40, seed=62)], params, use_tqdm=False)  # needs 5: 2 free + 3 evicted
    assert lookup(llm, Sequence(older)).num_cached_tokens == 0
    assert lookup(llm, Sequence(newer)).num_cached_tokens == 16


def test_workload_larger_than_pool(llama_dir, reference):
    prefixes = [random_prompt(32, seed=70 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + random_prompt(5 + 3 * i, seed=80 + i) for i in range(12)]
    params = greedy(10)
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=14, max_num_seqs=4)
    outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[::-1], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["evictions"] > 0 and stats["prefix_cache_hits"] > 0
    off = make_llm(llama_dir, block_size=8, num_kv_blocks=14, max_num_seqs=4, enable_prefix_caching=False)
    ref = off.generate(prompts, params, use_tqdm=False)
    reference.compare_all(prompts + prompts[::-1], outs, 10)
    reference.compare_all(prompts, ref, 10)
    assert_no_leak(llm)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_decode_attends_shared_prefix_once_for_the_batch(llama_dir, reference, monkeypatch, enforce_eager):
    """Sequences decoding over the same cached prefix blocks use the shared-prefix path (the
    prefix read once for the batch: PyTorch's kind, or with the compiled kernels theirs), and
    their tokens stay HF's."""
    from fast import attention

    llm = make_llm(llama_dir, block_size=8, enforce_eager=enforce_eager)
    backend = llm.llm_engine.engine_core.model_runner.backend
    calls = []
    if backend.paths.routes.shared_decode_kernel is None:  # enforce_eager, or a build without AVX-512
        real = attention.shared_prefix_decode
        monkeypatch.setattr(attention, "shared_prefix_decode", lambda *a: calls.append(a[3].batch) or real(*a))
    else:
        real = attention.KernelSharedDecode.attend
        monkeypatch.setattr(attention.KernelSharedDecode, "attend",
                            lambda self, *a: calls.append(self.rows.numel()) or real(self, *a))
    prefix = random_prompt(48, seed=90)
    prompts = [prefix + random_prompt(3 + 4 * i, seed=91 + i) for i in range(5)]
    llm.generate([prefix + [5]], greedy(1), use_tqdm=False)  # cache it
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert calls and max(calls) == 5
    reference.compare_all(prompts, outs, 12)
    assert_no_leak(llm)


def test_the_strategy_is_asked_only_in_the_chapters_section():
    """prefix_cache.py's section "2. the chapter's change" holds every line that depends on
    ``hash_strategy`` (the README sends readers there to see the chapter's difference): outside
    it, the constructor only validates and stores the choice."""
    import prefix_cache
    source = Path(prefix_cache.__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.strip().endswith("2. the chapter's change"))
    end = next(i for i, line in enumerate(source) if line.strip().endswith("3. lookup"))
    asked = [i for i, line in enumerate(source) if "self.hash_strategy" in line]
    inside = [i for i in asked if start < i < end]
    outside = [source[i].strip() for i in asked if not start < i < end]
    # _chain_for_lookup, _hash_for_save, and _hash_ahead (which calls a commit will make)
    assert len(inside) == 3, inside
    assert outside == ["self.hash_strategy = hash_strategy"], outside
    methods = [line.split("(")[0].split()[-1] for line in source[start:end] if line.strip().startswith("def ")]
    assert methods == ["_chain_for_lookup", "_hash_for_save", "_hash_ahead", "_precompute_block_hashes",
                       "_rebuild_chain", "_rehash_block"], methods


@pytest.mark.parametrize("strategy", ["recompute", "incremental"])
def test_hash_events_count_the_hash_calls(llama_dir, strategy):
    """Every hash call is one "hash" event and every "hash" event one call; a hash read off the
    Sequence is a "reuse" event (incremental only), over a workload with shared prefixes, blocks
    completed in decode, evictions and preemptions."""
    prefixes = [random_prompt(32, seed=70 + i) for i in range(3)]
    prompts = [prefixes[i % 3] + random_prompt(5 + 3 * i, seed=80 + i) for i in range(12)]
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=14, max_num_seqs=4, hash_strategy=strategy)
    kinds = []
    llm.prefix_cache.subscribe(lambda event: kinds.append(event.kind))
    llm.generate(prompts + prompts[::-1], greedy(10), use_tqdm=False)
    stats = llm.stats()
    assert stats["evictions"] > 0 and stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert kinds.count("hash") == stats["hash_computations"] > 0
    assert (kinds.count("reuse") > 0) == (strategy == "incremental")


def test_a_prompt_that_reads_no_cache_is_hashed_at_save_not_at_decode(llama_dir):
    """A request with prompt_logprobs reads no cache, so no lookup hashed its prompt: its prompt
    blocks are hashed when saved ("computed at save"), its generated ones at decode."""
    from prefix_cache import HashSource
    llm = make_llm(llama_dir, block_size=4)
    prompt = random_prompt(17, seed=95)  # 4 full prompt blocks
    with llm.prefix_cache.recording() as events:
        llm.generate([prompt], greedy(8, prompt_logprobs=1), use_tqdm=False)
    sources = {}
    for e in events:
        if e.kind == "hash":
            sources.setdefault(e.source, set()).add(e.index)
    assert sources[HashSource.SAVE] == {0, 1, 2, 3}
    assert sources[HashSource.DECODE] == {4, 5}  # tokens 16-23: completed while decoding
