"""Randomized workloads against a reference: nothing lost, nothing wrong, accounting exact.

Each hypothesis example builds one engine core from parts (around one shared loaded model) (block size 4/8/16, pool from barely enough for the
largest request to large, token budget from under one block to large, max_num_seqs 1..256,
prefix caching on/off, both hash strategies) and drives it through ``add_requests``/``step``
directly: requests arrive between steps (shared prefixes, repeated prompts, lengths of 1 and
exact block multiples, cache salts, stop tokens), some are aborted at a random step, the
prefix cache is reset at random steps, and some steps have an exception injected into the
model forward (before or after it wrote K/V) or into sampling. After every step
``check_accounting`` must hold; at the end nothing may be in use, every request that was not
aborted must have finished, and its greedy tokens, length and finish reason must equal the
same prompt's HF greedy tokens (run alone; up to the reference's first near-tie).

HYPOTHESIS_EXAMPLES (default 200) sets the number of examples, run in four shards, each from a
fixed seed (the run is reproducible).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from engine import SamplingParams
from helpers import add, drain, greedy, make_core, make_llm, random_prompt
from invariants import (FAULT_KINDS, FaultInjector, InjectedFault, assert_idle,
                        assert_nothing_committed, check_accounting, snapshot)

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", 200))
MAX_PROMPT, MAX_TOKENS = 80, 12
# A few fixed shared prefixes and suffix sources: prompts built from them repeat across
# examples (the references are memoised) and share blocks within an example.
PREFIXES = [random_prompt(MAX_PROMPT, seed=100 + i) for i in range(3)]
SUFFIXES = [random_prompt(MAX_PROMPT, seed=200 + i) for i in range(8)]


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    arrival: int                 # engine step before which it is added
    abort_at: int | None = None  # engine step before which abort() is called
    stop_index: int | None = None  # the reference token at this position is a stop token
    salt: str | None = None


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([4, 8, 16]))
    prefixes = draw(st.lists(st.integers(0, len(PREFIXES) - 1), min_size=1, max_size=3, unique=True))
    reqs, arrival = [], 0
    for _ in range(draw(st.integers(1, 8))):
        arrival += draw(st.sampled_from([0, 0, 0, 1, 2, 5]))
        max_tokens = draw(st.integers(1, MAX_TOKENS))
        abort_at = draw(st.one_of(st.none(), st.none(), st.none(),
                                  st.integers(arrival, arrival + 12)))
        if reqs and draw(st.integers(0, 4)) == 0:  # the same prompt again
            prompt = list(draw(st.sampled_from(reqs)).prompt)
        else:
            length = draw(st.one_of(
                st.just(1),
                st.sampled_from([k * bs for k in range(1, MAX_PROMPT // bs + 1)]),
                st.integers(1, MAX_PROMPT)))
            shared = draw(st.one_of(
                st.sampled_from([k * bs for k in range(0, length // bs + 1)]),
                st.integers(0, length)))
            prefix = PREFIXES[draw(st.sampled_from(prefixes))][:shared]
            suffix = SUFFIXES[draw(st.integers(0, len(SUFFIXES) - 1))]
            start = draw(st.integers(0, MAX_PROMPT - (length - shared)))
            prompt = prefix + suffix[start:start + length - shared]
        assert 1 <= len(prompt) <= MAX_PROMPT
        stop_index = draw(st.one_of(st.none(), st.none(), st.integers(0, max_tokens - 1)))
        salt = draw(st.sampled_from([None, None, None, "a", "b"]))
        reqs.append(Req(prompt, max_tokens, arrival, abort_at, stop_index, salt))
    need = max(-(-(len(r.prompt) + r.max_tokens - 1) // bs) for r in reqs)
    extra = draw(st.one_of(st.just(0), st.just(0), st.integers(1, 3), st.just(64)))
    budget = draw(st.one_of(st.just(bs), st.integers(bs, 4 * bs), st.just(2048),
                            st.integers(1, max(1, bs - 1))))
    faults = draw(st.one_of(
        st.just({}),
        st.dictionaries(st.integers(0, 25), st.sampled_from(FAULT_KINDS), max_size=3)))
    engine = dict(block_size=bs, num_kv_blocks=need + extra, max_num_batched_tokens=budget,
                  max_num_seqs=draw(st.sampled_from([1, 2, 3, 8, 256])),
                  enable_prefix_caching=draw(st.sampled_from([True, True, False])),
                  hash_strategy=draw(st.sampled_from(["incremental", "recompute"])))
    resets = draw(st.one_of(st.just(frozenset()), st.frozensets(st.integers(0, 25), max_size=2)))
    return engine, reqs, faults, resets


def stop_ids(reference, r: Req) -> list[int]:
    if r.stop_index is None:
        return []
    return [reference.get(r.prompt, r.max_tokens).tokens[r.stop_index]]


def run_workload(llm, reference, reqs: list[Req], faults: dict[int, str], resets=frozenset(),
                 max_steps: int = 5000):
    """Drive ``llm`` with ``reqs``; check accounting after every step. Returns
    (outputs by request index, indices aborted before finishing, faults fired)."""
    injector = FaultInjector(llm) if faults else None
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    ids: dict[str, int] = {}
    index_id: dict[int, str] = {}
    outputs: dict[int, object] = {}
    aborted: set[int] = set()
    step = 0
    while order or llm.has_unfinished:
        if not llm.has_unfinished and reqs[order[0]].arrival > step:
            step = reqs[order[0]].arrival  # idle engine: jump to the next arrival
        while order and reqs[order[0]].arrival <= step:
            i = order.pop(0)
            sp = greedy(reqs[i].max_tokens, stop_token_ids=stop_ids(reference, reqs[i]))
            rid = add(llm, reqs[i].prompt, sp, cache_salt=reqs[i].salt)
            assert rid not in ids
            ids[rid], index_id[i] = i, rid
            check_accounting(llm)
        for i, r in enumerate(reqs):
            if r.abort_at == step and i in index_id and i not in aborted:
                done = i in outputs
                assert llm.abort(index_id[i]) is (not done), (
                    f"abort() of a {'finished' if done else 'live'} request returned the wrong value")
                if not done:
                    aborted.add(i)
                assert llm.abort(index_id[i]) is False, "a second abort() found the request"
                check_accounting(llm)
        if step in resets:
            llm.reset_prefix_cache()
            check_accounting(llm)
        if not llm.has_unfinished:
            step += 1
            continue
        kind = faults.get(step)
        if kind is not None:
            before = snapshot(llm)
            injector.arm(kind)
            with pytest.raises(InjectedFault):
                llm.step()
            assert injector.armed is None, "the armed fault did not fire"
            check_accounting(llm)
            assert_nothing_committed(llm, before)
        else:
            for out in llm.step():
                i = ids[out.request_id]
                assert i not in outputs and i not in aborted, f"request {i} finished twice / after abort"
                outputs[i] = out
            check_accounting(llm)
        step += 1
        assert step < max_steps, "engine made no progress (livelock?)"
    return outputs, aborted, (injector.fired if injector else 0)


# Four shards of the examples, each from its own seed, so they spread over test workers.
SHARDS = 4


def covering_workload():
    """One fixed workload that has every kind the non-vacuity check counts: a tight pool
    (preemption), a shared prefix arriving later (cache hits), an abort and a fault. It runs
    in every shard before the drawn ones, so coverage does not hang on how a hypothesis
    version happens to draw."""
    base = PREFIXES[0][:32]
    reqs = [Req(base + SUFFIXES[i][:4 + i], 12, arrival=0 if i < 3 else 6) for i in range(5)]
    reqs[1].abort_at = 3
    bs = 4
    need = max(-(-(len(r.prompt) + r.max_tokens - 1) // bs) for r in reqs)
    engine = dict(block_size=bs, num_kv_blocks=need + 2, max_num_batched_tokens=2048,
                  max_num_seqs=8, enable_prefix_caching=True, hash_strategy="incremental")
    return engine, reqs, {2: "forward_after"}, frozenset()


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_workloads_match_reference(llama_dir, reference, shard):
    seen = dict(examples=0, requests=0, aborted=0, faults=0, cache_on=0, cache_hit_tokens=0,
                preemptions=0, steps=0)

    @seed(2026 + shard)
    @settings(max_examples=EXAMPLES // SHARDS, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(workload=workloads())
    @example(workload=covering_workload())
    def one_example(workload):
        engine, reqs, faults, resets = workload
        llm = make_core(llama_dir, **engine)
        outputs, aborted, fired = run_workload(llm, reference, reqs, faults, resets)
        assert_idle(llm)
        for i, r in enumerate(reqs):
            if i in aborted:
                assert i not in outputs
                continue
            assert i in outputs, f"request {i} was lost: no output and not aborted"
            out = outputs[i]
            assert out.prompt_token_ids == r.prompt
            reference.compare(r.prompt, out.token_ids, r.max_tokens, what=f"request {i} of {engine}",
                              stop_ids=stop_ids(reference, r), finish_reason=out.finish_reason)
        if not engine["enable_prefix_caching"]:
            assert llm.stats()["prefix_cache_hits"] == 0
        stats = llm.stats()
        for key, value in (("examples", 1), ("requests", len(reqs)), ("aborted", len(aborted)),
                           ("faults", fired), ("cache_on", engine["enable_prefix_caching"]),
                           ("cache_hit_tokens", stats["prefix_cache_hits"]),
                           ("preemptions", stats["preemptions"]), ("steps", stats["steps"])):
            seen[key] += value

    one_example()
    assert_not_vacuous(seen, reference, EXAMPLES // SHARDS)


def assert_not_vacuous(seen: dict, reference, examples: int) -> None:
    """The examples really exercised aborts, faults and the cache, and compared tokens."""
    assert seen["examples"] >= examples * 0.95, seen
    assert all(seen[k] > 0 for k in ("aborted", "faults", "cache_on", "cache_hit_tokens",
                                     "preemptions")), seen
    reference.assert_not_vacuous()


def test_seeded_sampling_independent_of_batch_cache_and_preemption(llama_dir):
    """Seeded random sampling (temperature, top-k, top-p) gives a request the same tokens
    alone on a cache-off engine as batched with others on a small pool with prefix caching,
    chunked prefill and preemption (the sampler draws a seeded request's noise from its own
    generator). Exact comparison: the prompts and seeds are fixed and pass."""
    base = random_prompt(24, 5)
    prompts = [base[:8 * (i % 4)] + random_prompt(3 + i % 7, 50 + i) for i in range(24)]
    params = [SamplingParams(temperature=(0.7, 1.0, 1.3)[i % 3], top_k=(-1, 20)[i % 2],
                             top_p=(1.0, 0.9, 1.0, 0.5)[i % 4], seed=1000 + i, max_tokens=8,
                             ignore_eos=True) for i in range(len(prompts))]
    alone = [make_llm(llama_dir, block_size=8, num_kv_blocks=8, enable_prefix_caching=False)
             .generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=6)
    rids, outs = [], {}
    for p, sp in zip(prompts, params):
        rids.append(llm.add_request(p, sp))
        outs.update((o.request_id, o) for o in llm.step())
        check_accounting(llm)
    outs.update(drain(llm))
    assert [outs[r].token_ids for r in rids] == alone
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_idle(llm)


def test_hash_collision_costs_only_a_miss(llama_dir, reference):
    """The prefix cache verifies every hit against the block's tokens and parent, so a hash
    collision "can only cost a miss". Forced collisions build the case a parent check by block
    id alone gets wrong: S0 caches Z under h=1; S1 = A|B|t: A's block P collides with Z (so P
    is not cached) and B's block K would name P as its parent; P is freed, reused by S2 = X|t
    and cached as X; S3 = X|B|t must not be served K, whose K/V were computed after A, not X.
    The engine refuses to cache a block whose parent is not cached, and parents are named by
    (block id, generation), so a reused block is never mistaken for the parent it replaced.
    """
    r = random_prompt(17, 9)
    Z, A, B, X, t = r[0:4], r[4:8], r[8:12], r[12:16], r[16:17]
    forced = {np.asarray(blk, dtype=np.int64).tobytes(): h for blk, h in ((Z, 1), (A, 1), (B, 2), (X, 3))}
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=32)
    llm.prefix_cache.hash_fn = lambda data, seed: forced.get(data, xxhash.xxh3_64_intdigest(data, seed=seed) | 1 << 40)
    for name, prompt in (("S0", Z + t), ("S1", A + B + t), ("S2", X + t), ("S3", X + B + t)):
        (out,) = llm.generate([prompt], greedy(6), use_tqdm=False)
        reference.compare(prompt, out.token_ids, 6, name)
    check_accounting(llm)
    assert_idle(llm)
