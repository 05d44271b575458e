"""Several threads on one engine: requests, aborts and generate() calls from any thread land
between steps, so every token equals the single-threaded run and nothing hangs.

The workload is the one that broke before the engine took a lock per step: tiny Llama, a pool
of 40 blocks of 8 (preemption and eviction happen), a 32-token budget (chunked prefill), 24
greedy prompts sharing a 17-token prefix, 12 tokens each. After every trial the engine must be
idle with every block free, and the same batch run alone must still give the reference
tokens (a poisoned prefix cache would not).
"""
from __future__ import annotations

import random
import threading

import pytest

from helpers import greedy, make_llm, random_prompt
from invariants import assert_idle

NUM_PROMPTS, MAX_TOKENS, TRIALS = 24, 12, 6
ENGINE = dict(num_kv_blocks=40, block_size=8, max_num_batched_tokens=32)
JOIN_S = 120  # a thread still alive after this is a hang


def prompts() -> list[list[int]]:
    prefix = random_prompt(17, seed=5)
    return [prefix + random_prompt(3 + i % 7, seed=100 + i) for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[list[int]]:
    """Each prompt's tokens, one thread, one generate() call."""
    llm = make_llm(llama_dir, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), greedy(MAX_TOKENS), use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir, **ENGINE)


def run_threads(*targets) -> list:
    """Run each target in its own thread; their exceptions are re-raised here; no hang."""
    errors: list[BaseException] = []

    def guarded(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def check_still_clean(llm, reference) -> None:
    assert_idle(llm)
    again = llm.generate(prompts(), greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference, "the prefix cache was poisoned"
    assert_idle(llm)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_two_threads_generating_get_the_single_threaded_tokens(llm, reference, trial):
    ps, got = prompts(), {}
    rng = random.Random(trial)
    order = list(range(NUM_PROMPTS))
    rng.shuffle(order)
    halves = [order[:NUM_PROMPTS // 2], order[NUM_PROMPTS // 2:]]

    def generate(indices):
        outs = llm.generate([ps[i] for i in indices], greedy(MAX_TOKENS), use_tqdm=False)
        got.update({i: o.outputs[0].token_ids for i, o in zip(indices, outs)})

    run_threads(*(lambda h=h: generate(h) for h in halves))
    assert [got[i] for i in range(NUM_PROMPTS)] == reference
    check_still_clean(llm, reference)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_aborts_from_another_thread_leave_the_rest_exact(llm, reference, trial):
    engine, ps, rng = llm.llm_engine, prompts(), random.Random(trial)
    ids = [engine.add_request(f"t{trial}-{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(ps)]
    doomed = set(rng.sample(ids, 8))
    finals: dict[str, list[int]] = {}

    def step_loop():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids

    def aborter():
        for rid in doomed:
            threading.Event().wait(rng.random() * 0.01)
            engine.abort_request(rid)

    run_threads(step_loop, aborter)
    for i, rid in enumerate(ids):
        if rid not in doomed:
            assert finals[rid] == reference[i], f"request {rid} got other tokens"
        elif rid in finals:  # it finished before its abort arrived
            assert finals[rid] == reference[i]
    check_still_clean(llm, reference)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_producer_thread_adding_while_another_steps(llm, reference, trial):
    engine, ps, rng = llm.llm_engine, prompts(), random.Random(trial)
    finals: dict[str, list[int]] = {}
    produced = threading.Event()

    def producer():
        for i, p in enumerate(ps):
            engine.add_request(f"p{trial}-{i}", p, greedy(MAX_TOKENS))
            threading.Event().wait(rng.random() * 0.005)
        produced.set()

    def step_loop():
        while not produced.is_set() or engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids

    run_threads(producer, step_loop)
    assert [finals[f"p{trial}-{i}"] for i in range(NUM_PROMPTS)] == reference
    check_still_clean(llm, reference)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_mix_of_threads_against_the_reference(llm, reference, trial):
    """generate() calls, add_request + step loops and aborts, all at once, at random."""
    engine, ps, rng = llm.llm_engine, prompts(), random.Random(1000 + trial)
    split = sorted(rng.sample(range(1, NUM_PROMPTS), 2))
    by_generate, by_engine = list(range(split[0])), list(range(split[0], NUM_PROMPTS))
    doomed = set(rng.sample(by_engine, 3))
    got: dict[int, list[int]] = {}
    done = threading.Event()

    def generate():
        outs = llm.generate([ps[i] for i in by_generate], greedy(MAX_TOKENS), use_tqdm=False)
        got.update({i: o.outputs[0].token_ids for i, o in zip(by_generate, outs)})

    def add_and_abort():
        for i in by_engine:
            engine.add_request(f"m{trial}-{i}", ps[i], greedy(MAX_TOKENS))
        for i in doomed:
            threading.Event().wait(rng.random() * 0.01)
            engine.abort_request(f"m{trial}-{i}")
        done.set()

    def step_loop():
        while not done.is_set() or engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids

    run_threads(generate, add_and_abort, step_loop)
    for i in range(NUM_PROMPTS):
        if i not in doomed:
            assert got[i] == reference[i], f"prompt {i} got other tokens"
    check_still_clean(llm, reference)
