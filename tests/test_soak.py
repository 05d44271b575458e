"""Soak: 2,000 short requests through a small pool with heavy prefix sharing.

Waves of requests go in through ``add_request`` (with a few steps between waves, and some
requests aborted while queued or running) and through ``generate`` batches. The accounting
is checked after every step; every finished request is compared with HF greedy on the
prompt alone; at the end nothing is held and nothing grew: no block in use,
the free queue holds the whole pool, the prefix cache has at most one entry per block, no
request or queue entry is left, no finished ``Sequence`` is still alive, and no more Python
engine objects of any class are alive at the end than at the idle midpoint (1,000 requests).
"""
from __future__ import annotations

import gc
from collections import Counter
import weakref

import numpy as np

from engine import Sequence
from helpers import greedy, make_llm, random_prompt, sequence_of
from invariants import assert_idle, check_accounting

NUM_REQUESTS = 2000
ENGINE_MODULES = {"engine", "scheduler", "block_manager", "prefix_cache", "sampler", "model", "outputs"}


def _census() -> Counter:
    """Live instances of every class the engine's modules define (after a full collection)."""
    gc.collect()
    return Counter(type(x).__qualname__ for x in gc.get_objects()
                   if type(x).__module__ in ENGINE_MODULES)


def test_soak_2000_requests(llama_dir, reference):
    rng = np.random.default_rng(2024)
    bs = 4
    llm = make_llm(llama_dir, block_size=bs, num_kv_blocks=20, max_num_seqs=12,
                   max_num_batched_tokens=48)
    prefixes = [random_prompt(n, 300 + n) for n in (8, 11, 16)]
    suffixes = [random_prompt(3, 400 + i) for i in range(8)]

    def make_request():
        prompt = prefixes[rng.integers(len(prefixes))] + suffixes[rng.integers(len(suffixes))][:rng.integers(0, 4)]
        return prompt, int(rng.integers(1, 5))

    results = []        # (prompt, max_tokens, output)
    # Sequences other tests left alive, held so that their ids stay theirs during the soak.
    others = [x for x in gc.get_objects() if type(x) is Sequence]
    watched = []        # weakrefs to some Sequences
    aborted = 0
    steps = 0
    peak_cached = 0
    mid_census = None
    submitted = 0

    def step():
        nonlocal steps, peak_cached
        outs = llm.step()
        steps += 1
        check_accounting(llm)
        peak_cached = max(peak_cached, llm.prefix_cache.num_cached_blocks)
        return outs

    pending: dict[str, tuple] = {}
    while submitted < NUM_REQUESTS:
        if submitted >= NUM_REQUESTS // 2 and mid_census is None:
            while llm.has_unfinished_requests():
                for o in step():
                    results.append((*pending.pop(o.request_id), o))
            mid_census, attrs_mid = _census(), set(vars(llm))
        wave = int(min(rng.integers(1, 40), NUM_REQUESTS - submitted))
        if rng.random() < 0.3 and not llm.has_unfinished_requests():
            reqs = [make_request() for _ in range(wave)]
            outs = llm.generate([p for p, _ in reqs],
                                [greedy(n) for _, n in reqs], use_tqdm=False)
            for (p, n), o in zip(reqs, outs):
                results.append((p, n, o))
            submitted += wave
            continue
        for _ in range(wave):
            p, n = make_request()
            rid = llm.add_request(p, greedy(n))
            pending[rid] = (p, n)
            if len(watched) < 200 and rng.random() < 0.2:
                watched.append(weakref.ref(sequence_of(llm, rid)))
        submitted += wave
        for _ in range(int(rng.integers(1, 6))):
            if rng.random() < 0.15 and pending:  # abort a queued or running request
                rid = list(pending)[int(rng.integers(len(pending)))]
                assert llm.abort(rid) is True
                pending.pop(rid)
                aborted += 1
                check_accounting(llm)
            if llm.has_unfinished_requests():
                for o in step():
                    results.append((*pending.pop(o.request_id), o))
    while llm.has_unfinished_requests():
        for o in step():
            results.append((*pending.pop(o.request_id), o))

    assert not pending, f"{len(pending)} requests never finished"
    assert len(results) + aborted == NUM_REQUESTS
    assert aborted > 0
    for p, n, o in results:
        reference.compare(p, o.token_ids, n, f"request {o.request_id}",
                          finish_reason=o.finish_reason)
    reference.assert_not_vacuous(0.9)

    # nothing leaked, nothing grew (assert_idle: no request registered, queued or running)
    assert_idle(llm)
    bm = llm.block_manager
    assert len(bm.free_queue) == bm.num_blocks == 20
    assert llm.prefix_cache.num_cached_blocks <= bm.num_blocks and peak_cached <= bm.num_blocks
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0.3 * stats["prefix_cache_queries"], stats
    assert stats["preemptions"] > 0 and stats["evictions"] > 0, stats
    results.clear()
    o = outs = reqs = None  # drop the test's own references to outputs
    end_census = _census()
    assert sum(r() is not None for r in watched) == 0, "finished Sequences are still referenced"
    earlier = {id(x) for x in others}
    alive = [x for x in gc.get_objects() if type(x) is Sequence and id(x) not in earlier]
    assert not alive, f"{len(alive)} finished Sequences still alive, e.g. {alive[:3]}"
    grown = {k: (mid_census.get(k, 0), v) for k, v in end_census.items() if v > mid_census.get(k, 0)}
    assert not grown, f"engine objects grew between the idle midpoint and the end: {grown}"
    assert set(vars(llm)) == attrs_mid, "the engine grew new attributes"
    print(f"\nsoak: {NUM_REQUESTS} requests, {aborted} aborted, {steps} steps, {stats}")
