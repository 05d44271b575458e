"""Streams that add up: each request's outputs follow its own ``output_kind``, whatever else
runs meanwhile (other requests, a ``generate()`` call that does the stepping).

For every request: the DELTA outputs concatenate to the CUMULATIVE final output, FINAL_ONLY
gives exactly that final output once, prompt logprobs come once. Request ids name requests
only, so an automatic id never collides with a child sequence's label.
"""
from __future__ import annotations

import random

import pytest

from engine import RequestOutputKind, SamplingParams
from helpers import greedy, make_llm, random_prompt
from invariants import assert_idle

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir, num_kv_blocks=48, block_size=8, max_num_batched_tokens=24)


def collect(engine, outputs: dict) -> None:
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)


def joined(outs) -> tuple[list[int], str]:
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    return tokens, "".join(o.outputs[0].text for o in outs)


def test_delta_finishing_inside_generate_adds_up(llm):
    """The DELTA request gets 3 tokens by step(), then finishes while generate() steps: the
    deltas still add up to exactly its 12 tokens."""
    engine, outputs = llm.llm_engine, {}
    params = greedy(12, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", random_prompt(9, seed=1), params)
    while sum(len(o.outputs[0].token_ids) for o in outputs.get("delta", [])) < 3:
        collect(engine, outputs)
    llm.generate([random_prompt(30, seed=2)], greedy(20), use_tqdm=False)
    while engine.has_unfinished_requests():
        collect(engine, outputs)
    tokens, _ = joined(outputs["delta"])
    alone = llm.generate([random_prompt(9, seed=1)], greedy(12), use_tqdm=False)[0]
    assert tokens == alone.outputs[0].token_ids and len(tokens) == 12
    assert outputs["delta"][-1].finished and not any(o.finished for o in outputs["delta"][:-1])
    assert_idle(llm)


def test_delta_sends_prompt_logprobs_once(llm):
    engine, outputs = llm.llm_engine, {}
    params = greedy(5, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    engine.add_request("p", random_prompt(10, seed=3), params)
    while engine.has_unfinished_requests():
        collect(engine, outputs)
    sent = [o.prompt_logprobs for o in outputs["p"] if o.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == 10, "one prompt-logprobs list, one entry per token"
    assert sum(len(o.outputs[0].token_ids) for o in outputs["p"]) == 5


def test_one_token_prompt_has_one_prompt_logprob_entry(llm):
    out = llm.generate([[7]], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_automatic_ids_never_collide_with_child_labels(llama_dir):
    """add_request("0_1") on a fresh engine, then generate(n=2): automatic id "1" (child
    labels "0_1", "1_1") must not be refused."""
    llm = make_llm(llama_dir)
    llm.add_request(random_prompt(6, seed=4), greedy(3), request_id="0_1")
    outs = llm.generate([random_prompt(6, seed=5)] * 3,
                        SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=1), use_tqdm=False)
    assert len(outs) == 3 and all(len(o.outputs) == 2 for o in outs)
    assert len({o.request_id for o in outs} | {"0_1"}) == 4
    while llm.has_unfinished_requests():
        llm.step()
    assert_idle(llm)


def test_text_is_empty_string_without_detokenizing(llm):
    out = llm.generate([random_prompt(5, seed=6)], greedy(3, detokenize=False), use_tqdm=False)[0]
    assert out.outputs[0].text == ""


@pytest.mark.parametrize("trial", range(8))
def test_every_kind_adds_up_whatever_runs_meanwhile(llm, trial):
    """Requests of all three kinds (n = 1 or 2, some with logprobs) stepped by step() and by
    generate() calls in between; each kind's outputs reconstruct the same final output."""
    rng, engine, outputs = random.Random(trial), llm.llm_engine, {}
    specs = {}
    for i in range(6):
        prompt = random_prompt(rng.randint(4, 30), seed=1000 * trial + i)
        n = rng.choice((1, 2))
        base = dict(max_tokens=rng.randint(3, 14), ignore_eos=True, n=n, seed=i,
                    temperature=0.0 if n == 1 else 0.8, logprobs=rng.choice((None, 2)))
        for kind in KINDS:
            rid = f"{trial}-{i}-{kind.name}"
            specs[rid] = (kind, i)
            engine.add_request(rid, prompt, SamplingParams(**base, output_kind=kind))
    while engine.has_unfinished_requests():
        collect(engine, outputs)
        if rng.random() < 0.3:
            llm.generate([random_prompt(rng.randint(3, 20), seed=rng.randint(0, 999))],
                         greedy(rng.randint(1, 6)), use_tqdm=False)
    for i in range(6):
        final = outputs[f"{trial}-{i}-CUMULATIVE"][-1]
        only = outputs[f"{trial}-{i}-FINAL_ONLY"]
        deltas = outputs[f"{trial}-{i}-DELTA"]
        assert final.finished and len(only) == 1 and only[0].finished
        for c, (f_out, o_out) in enumerate(zip(final.outputs, only[0].outputs)):
            assert o_out.token_ids == f_out.token_ids and o_out.text == f_out.text
            tokens = [t for d in deltas for t in d.outputs[c].token_ids]
            assert tokens == f_out.token_ids, f"request {i}, completion {c}: deltas do not add up"
            if f_out.logprobs is not None:
                assert sum(len(d.outputs[c].logprobs) for d in deltas) == len(f_out.logprobs)
    assert_idle(llm)


def test_automatic_ids_skip_ids_asked_for_in_the_same_batch(llama_dir):
    engine = make_llm(llama_dir).llm_engine
    engine.add_request("0", random_prompt(4, seed=7), greedy(2))
    states = engine.add_requests([(random_prompt(4, seed=8 + i), greedy(2)) for i in range(3)],
                                 request_ids=[None, None, "1"])
    ids = [s.request_id for s in states]
    assert ids[2] == "1" and len(set(ids) | {"0"}) == 4, ids
    with pytest.raises(ValueError, match="already in use"):
        engine.add_requests([(random_prompt(4, seed=9), greedy(2))], request_ids=["1"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)
