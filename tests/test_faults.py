"""Aborts and faults inside an engine step: nothing lost, nothing leaked, nothing wrong.

``LLM.abort(request_id)`` cancels a queued, running (mid-prefill or mid-decode) or preempted
request: its blocks return to the pool, the full blocks it computed stay in the prefix cache,
the other requests finish with the right tokens.

An exception inside ``step()`` (model forward or sampling) commits nothing: no token is
appended, no block registered, no counter moved; the step's sequences keep their blocks and
are scheduled again by the next step, which then does exactly what the failed step would
have done. ``generate()`` that raises aborts its own unfinished requests, and only those.
"""
from __future__ import annotations

import gc
import weakref

import pytest

from engine import SamplingParams
from helpers import drain, greedy, make_llm, random_prompt, sequence_of
from invariants import (FAULT_KINDS, FaultInjector, InjectedFault, assert_idle,
                        assert_nothing_committed, check_accounting, snapshot)
from scheduler import SequenceStatus


def _collected(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


# ---------------------------------------------------------------------------- abort

@pytest.mark.parametrize("strategy", ["incremental", "recompute"])
def test_abort_mid_prefill_returns_blocks_and_keeps_computed_ones_cached(llama_dir, reference, strategy):
    bs = 4
    llm = make_llm(llama_dir, block_size=bs, num_kv_blocks=64, max_num_batched_tokens=6,
                   hash_strategy=strategy)
    a, b = random_prompt(41, 21), random_prompt(13, 22)
    rid_a, rid_b = llm.add_request(a, greedy(6)), llm.add_request(b, greedy(6))
    seq_a = sequence_of(llm, rid_a)
    for _ in range(3):  # 6 tokens per step: a's prefill spans 7 steps
        assert llm.step() == []
        check_accounting(llm)
    assert seq_a.status is SequenceStatus.RUNNING and seq_a.num_output_tokens == 0
    assert 0 < seq_a.num_computed_tokens < len(a), "a must be mid-prefill"
    full = seq_a.num_computed_tokens // bs
    assert full >= 2
    bm = llm.block_manager
    computed = [bm.blocks[i] for i in seq_a.block_table[:full]]
    rest = [bm.blocks[i] for i in seq_a.block_table[full:]]
    in_use = llm.stats()["blocks_in_use"]

    assert llm.abort(rid_a) is True
    check_accounting(llm)
    assert seq_a.status is SequenceStatus.FINISHED and seq_a.finish_reason == "abort"
    assert seq_a.block_table == [] and sequence_of(llm, rid_a) is None
    assert llm.stats()["blocks_in_use"] == in_use - len(computed) - len(rest)
    assert all(blk.ref_count == 0 and blk.in_free_queue for blk in computed + rest)
    assert all(llm.prefix_cache.entries.get(blk.block_hash) is blk for blk in computed), \
        "the aborted request's computed blocks must stay in the prefix cache"
    assert all(blk.block_hash is None for blk in rest), "a half-computed block was cached"
    assert llm.abort(rid_a) is False
    seq_ref = weakref.ref(seq_a)
    del seq_a
    assert _collected(seq_ref), "the engine still references the aborted Sequence"

    outs = drain(llm)
    assert set(outs) == {rid_b}, "only b may finish; a was aborted"
    reference.compare(b, outs[rid_b].token_ids, 6, "b", finish_reason=outs[rid_b].finish_reason)
    assert_idle(llm)

    # A later request with a's prompt reuses every block a computed before it was aborted.
    hits = llm.stats()["prefix_cache_hits"]
    rid = llm.add_request(a, greedy(6))
    seq = sequence_of(llm, rid)
    llm.step()
    assert llm.stats()["prefix_cache_hits"] - hits == full * bs
    assert seq.block_table[:full] == [blk.block_id for blk in computed]
    del seq
    outs = drain(llm)
    reference.compare(a, outs[rid].token_ids, 6, "a again")
    assert_idle(llm)


def test_abort_mid_decode(llama_dir, reference):
    bs = 8
    llm = make_llm(llama_dir, block_size=bs, num_kv_blocks=64)
    a, b = random_prompt(21, 31), random_prompt(30, 32)
    rid_a, rid_b = llm.add_request(a, greedy(12)), llm.add_request(b, greedy(12))
    seq_a = sequence_of(llm, rid_a)
    while seq_a.num_output_tokens < 5:
        assert llm.step() == []
        check_accounting(llm)
    partial = seq_a.output_token_ids
    reference.compare(a, partial, 5, "a before abort")
    full = seq_a.num_computed_tokens // bs  # 25 computed: 3 full blocks, 3 generated tokens in them
    assert full == 3
    computed = [llm.block_manager.blocks[i] for i in seq_a.block_table[:full]]
    assert llm.abort(rid_a) is True
    check_accounting(llm)
    assert all(llm.prefix_cache.entries.get(blk.block_hash) is blk for blk in computed)
    del seq_a

    outs = drain(llm)
    assert set(outs) == {rid_b}
    reference.compare(b, outs[rid_b].token_ids, 12, "b")
    assert_idle(llm)

    # same prompt: all its full blocks but the last token's; the prompt plus the tokens a had
    # generated: every block a computed, generated tokens included
    for prompt, expect in ((a, (len(a) - 1) // bs), (a + partial, full)):
        hits = llm.stats()["prefix_cache_hits"]
        (out,) = llm.generate([prompt], greedy(4), use_tqdm=False)
        assert llm.stats()["prefix_cache_hits"] - hits == expect * bs
        reference.compare(prompt, out.token_ids, 4)
        assert_idle(llm)


def test_abort_waiting_and_preempted_requests(llama_dir, reference):
    bs = 4
    llm = make_llm(llama_dir, block_size=bs, num_kv_blocks=7, max_num_seqs=2)
    prompts = [random_prompt(10, 41), random_prompt(10, 42), random_prompt(9, 43)]
    rids = [llm.add_request(p, greedy(10)) for p in prompts]
    seqs = [sequence_of(llm, r) for r in rids]
    llm.step()
    check_accounting(llm)
    # max_num_seqs=2: the third request was never admitted
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    free = llm.stats()["free_blocks"]
    assert llm.abort(rids[2]) is True
    check_accounting(llm)
    assert llm.stats()["free_blocks"] == free and seqs[2].finish_reason == "abort"

    # 7 blocks cannot hold both running requests to the end: the later one is preempted
    outs = {}
    while llm.scheduler.stats.preemptions == 0:
        for o in llm.step():
            outs[o.request_id] = o
        check_accounting(llm)
    assert seqs[1].status is SequenceStatus.WAITING and seqs[1].num_output_tokens > 0
    assert seqs[1].block_table == []
    assert llm.abort(rids[1]) is True
    check_accounting(llm)
    assert list(llm.scheduler.waiting) == []
    outs.update(drain(llm))
    assert set(outs) == {rids[0]}
    reference.compare(prompts[0], outs[rids[0]].token_ids, 10)
    assert_idle(llm)


def test_abort_unknown_or_finished_request(llama_dir):
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=16)
    assert llm.abort("no-such-request") is False
    rid = llm.add_request(random_prompt(5, 1), greedy(1))
    outs = drain(llm)
    assert set(outs) == {rid}
    assert llm.abort(rid) is False
    assert_idle(llm)


def test_abort_everything_mid_flight_then_generate(llama_dir, reference):
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=24, max_num_batched_tokens=12,
                   max_num_seqs=3)
    base = random_prompt(16, 71)
    prompts = [base + random_prompt(k, 72 + k) for k in (1, 4, 7, 9, 12)]
    rids = [llm.add_request(p, greedy(8)) for p in prompts]
    for _ in range(4):
        llm.step()
        check_accounting(llm)
    assert llm.scheduler.running and llm.scheduler.waiting
    for rid in reversed(rids):
        assert llm.abort(rid) is True
        check_accounting(llm)
    assert_idle(llm)
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        reference.compare(p, o.token_ids, 8)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert_idle(llm)


# ---------------------------------------------------------------------------- faults in a step

def _state(llm, rids):
    """Per request (in add order): what a step commits."""
    out = []
    for rid in rids:
        seq = sequence_of(llm, rid)
        out.append(None if seq is None else
                   (seq.status, seq.num_tokens, seq.num_computed_tokens, seq.output_token_ids,
                    len(seq.block_table)))
    return out


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_failed_step_commits_nothing_and_is_redone_by_the_next(llama_dir, reference, kind, caching):
    """A twin engine runs the same requests without faults; after each failed step and its
    retry the faulted engine is exactly where the twin is after that one step."""
    cfg = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=10,
               enable_prefix_caching=caching)
    twin, llm = make_llm(llama_dir, **cfg), make_llm(llama_dir, **cfg)
    shared = random_prompt(23, 52)
    prompts = [random_prompt(9, 51), shared, shared, random_prompt(6, 53), shared[:12] + [7, 8]]
    max_tokens = [7, 5, 5, 4, 6]
    ids = {}
    for eng in (twin, llm):
        ids[eng] = [eng.add_request(p, greedy(n)) for p, n in zip(prompts, max_tokens)]
    injector = FaultInjector(llm)
    fault_steps = {0, 1, 3, 4, 6, 9}
    outs = {twin: {}, llm: {}}
    step = 0
    while twin.has_unfinished_requests():
        if step in fault_steps:
            before = snapshot(llm)
            injector.arm(kind)
            with pytest.raises(InjectedFault):
                llm.step()
            check_accounting(llm)
            assert_nothing_committed(llm, before)
        for eng in (twin, llm):
            for o in eng.step():
                outs[eng][ids[eng].index(o.request_id)] = o.token_ids
            check_accounting(eng)
        assert _state(llm, ids[llm]) == _state(twin, ids[twin]), f"diverged after step {step}"
        assert llm.stats()["blocks_cached"] == twin.stats()["blocks_cached"]
        if caching:
            assert set(llm.prefix_cache.entries) == set(twin.prefix_cache.entries)
        assert outs[llm] == outs[twin]
        step += 1
    assert injector.fired == len(fault_steps)
    assert not llm.has_unfinished_requests()
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        reference.compare(p, outs[llm][i], n, f"request {i}")
    assert_idle(llm)
    assert_idle(twin)
    # and the engine keeps working
    out = llm.generate(prompts[:2], greedy(5), use_tqdm=False)
    for p, o in zip(prompts, out):
        reference.compare(p, o.token_ids, 5)
    assert_idle(llm)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_generate_that_raises_aborts_only_its_own_requests(llama_dir, reference, kind):
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=32, max_num_batched_tokens=16)
    x = random_prompt(30, 61)
    rid_x = llm.add_request(x, greedy(12))  # someone else's request, queued before generate()
    seq_x = sequence_of(llm, rid_x)
    injector = FaultInjector(llm)
    prompts = [random_prompt(20, 62), random_prompt(11, 63), x[:16] + [9]]
    injector.arm(kind, skip=2)
    with pytest.raises(InjectedFault):
        llm.generate(prompts, greedy(6), use_tqdm=False)
    check_accounting(llm)
    queued = list(llm.scheduler.running) + list(llm.scheduler.waiting)
    assert [s.request_id for s in queued] == [rid_x], "generate() left its own requests behind"
    assert queued[0] is seq_x and not seq_x.is_finished
    assert seq_x.num_output_tokens < 12
    assert llm.stats()["blocks_in_use"] == len(seq_x.block_table)
    outs = drain(llm)
    assert set(outs) == {rid_x}
    reference.compare(x, outs[rid_x].token_ids, 12, "x")
    assert_idle(llm)
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    for p, o in zip(prompts, outs):
        reference.compare(p, o.token_ids, 6)
    assert_idle(llm)


def test_repeated_faults_never_leak(llama_dir, reference):
    """Every step of a workload fails once before it succeeds; generate() calls that fail
    part-way are retried; in the end every prompt is right and nothing is held."""
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                   max_num_seqs=3)
    injector = FaultInjector(llm)
    base = random_prompt(12, 81)
    prompts = [base + random_prompt(k, 82 + k) for k in range(1, 7)]
    rids = [llm.add_request(p, greedy(5)) for p in prompts]
    outs, n = {}, 0
    while llm.has_unfinished_requests():
        injector.arm(FAULT_KINDS[n % 3])
        n += 1
        with pytest.raises(InjectedFault):
            llm.step()
        check_accounting(llm)
        for o in llm.step():
            outs[o.request_id] = o
        check_accounting(llm)
    assert set(outs) == set(rids)
    for p, rid in zip(prompts, rids):
        reference.compare(p, outs[rid].token_ids, 5)
    assert_idle(llm)
    for skip in range(0, 12, 3):
        injector.arm(FAULT_KINDS[skip % 3], skip=skip)
        with pytest.raises(InjectedFault):
            llm.generate(prompts, greedy(5), use_tqdm=False)
        assert_idle(llm)
    for p, o in zip(prompts, llm.generate(prompts, greedy(5), use_tqdm=False)):
        reference.compare(p, o.token_ids, 5)
    assert_idle(llm)


# ---------------------------------------------------------------------------- bugs these tests found (fixed)

@pytest.mark.parametrize("kind", ["forward_after", "sampler"])
def test_seeded_sampling_is_reproducible_across_a_failed_step(llama_dir, kind):
    """A seeded request's tokens must not depend on a step that failed and committed nothing.

    Found with a failure inside sampling, after the draw: a per-request generator advanced by
    a draw in a step that then failed made the retry sample other tokens. The noise is now
    seeded from (seed, tokens generated so far), so a retried step draws the same noise.
    """
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True, logprobs=1)
    prompt = random_prompt(20, 3)
    (clean,) = make_llm(llama_dir, block_size=8, num_kv_blocks=16).generate([prompt], sp, use_tqdm=False)
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=16)
    FaultInjector(llm).arm(kind, skip=2)  # the third step fails (after the forward / the draw)
    rid = llm.add_request(prompt, sp)
    outs, failures = {}, 0
    while llm.has_unfinished_requests():
        try:
            outs.update({o.request_id: o for o in llm.step()})
        except InjectedFault:
            failures += 1
        check_accounting(llm)
    assert failures == 1
    assert outs[rid].token_ids == clean.token_ids, (
        f"seeded request sampled {outs[rid].token_ids} after a failed step, "
        f"{clean.token_ids} without it")
    assert_idle(llm)


def test_request_finishing_inside_another_generate_is_not_lost(llama_dir, reference):
    """A request queued with add_request() that finishes while generate() is stepping the
    engine must still reach its caller: from a later step() (found: it used to be dropped).
    """
    llm = make_llm(llama_dir, block_size=8, num_kv_blocks=32)
    x = random_prompt(9, 91)
    rid = llm.add_request(x, greedy(2))
    outs = llm.generate([random_prompt(14, 92)], greedy(8), use_tqdm=False)
    check_accounting(llm)
    assert sequence_of(llm, rid) is None  # x finished during generate()
    delivered = {o.request_id: o for o in outs}
    delivered.update(drain(llm))
    assert rid in delivered, "x finished inside another caller's generate() and its output was dropped"
    reference.compare(x, delivered[rid].token_ids, 2)


def test_fault_while_emitting_outputs_does_not_wedge_the_engine(tokenizer_ckpt, reference):
    """An exception while a step builds its outputs (here: detokenizing a finished request)
    must neither lose that request's tokens nor leave the other sequences of the step
    unschedulable. The engine commits every token before building outputs, and a failed
    decode gives ``text=None`` with a warning instead of aborting the batch.
    """
    llm = make_llm(tokenizer_ckpt, block_size=4, num_kv_blocks=32)
    real_decode = llm.tokenizer.decode
    calls = []

    def decode_fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise InjectedFault("detokenizer")
        return real_decode(*args, **kwargs)
    llm.tokenizer.decode = decode_fails_once
    prompts = [random_prompt(6, 1), random_prompt(7, 2), random_prompt(5, 3)]
    max_tokens = [1, 3, 3]  # the first finishes (and is detokenized) in the first step
    rids = [llm.add_request(p, greedy(n)) for p, n in zip(prompts, max_tokens)]
    with pytest.warns(UserWarning, match="could not decode"):
        first = llm.step()
    assert [o.request_id for o in first] == [rids[0]]
    assert first[0].text == "" and len(first[0].token_ids) == 1  # no text, as vLLM gives ""
    reference.compare(prompts[0], first[0].token_ids, 1, "request 0")
    check_accounting(llm)
    outs = drain(llm, max_steps=50)
    for i in (1, 2):
        reference.compare(prompts[i], outs[rids[i]].token_ids, max_tokens[i], f"request {i}")
    assert_idle(llm)
