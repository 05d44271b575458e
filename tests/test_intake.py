"""Request intake: every parameter is checked when it is given (construction) and again on the
engine's own copy at submission, so nothing that submission accepts can make a step raise.
Each class of hole from the issue has a test here: parameters mutated after submission, seeds
outside 64 bits or not integers, logprobs above the vocabulary or not integers, tiny or NaN
temperatures, vocab-bounded token ids, the EOS fallback, and a request whose detokenizer fails."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from engine import SamplingParams
from invariants import assert_idle
from helpers import (VOCAB_SIZE, assert_no_leak, check_accounting, drain, greedy, make_llm,
                     random_prompt)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir, block_size=16, max_model_len=128)


# ----------------------------------------------------------------------- construction

@pytest.mark.parametrize("kw,pattern", [
    (dict(n=0), "n must"), (dict(n=1.0), "n must"), (dict(n=True), "n must"),
    (dict(temperature=float("nan")), "temperature must be a finite"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=2.5), "temperature"),
    (dict(temperature="0.5"), "temperature must be a number"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_k=2.0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(seed="7"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=2 ** 64), "seed"),
    (dict(seed=-(2 ** 63) - 1), "seed"),
    (dict(logprobs=1.5), "logprobs"), (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs="3"), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"), (dict(stop="x", detokenize=False), "stop"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"), (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(temperature=0.0, n=2), "n must be 1"),
])
def test_bad_values_are_rejected_naming_the_field(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kw)


def test_vllm_spellings_are_normalised():
    sp = SamplingParams(stop="END", stop_token_ids=[5, 5, 7], logprobs=True, seed=-1,
                        logit_bias={"12": 1, 3: -2}, top_k=-1, max_tokens=None)
    assert sp.stop == ["END"] and sp.stop_token_ids == [5, 7] and sp.logprobs == 1
    assert sp.seed is None  # vLLM: -1 means no seed
    assert sp.logit_bias == {12: 1.0, 3: -2.0} and sp.top_k_or_none is None
    assert SamplingParams().top_k == 0 and SamplingParams().max_tokens == 16  # vLLM's defaults
    greedy_sp = SamplingParams(temperature=0.0, top_k=5, top_p=0.3, min_p=0.2)
    assert (greedy_sp.top_k, greedy_sp.top_p, greedy_sp.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(seed=np.int64(3), n=np.int32(2)).n == 2


def test_cache_salt_is_not_a_sampling_parameter():
    with pytest.raises(TypeError):
        SamplingParams(cache_salt="tenant")  # vLLM takes it in the prompt dict


def test_tiny_temperature_is_raised_and_samples_normally(llm):
    with pytest.warns(UserWarning, match="raised to 0.01"):
        sp = SamplingParams(temperature=1e-38, max_tokens=6, ignore_eos=True, seed=0)
    assert sp.temperature == 0.01 and not sp.greedy
    (out,) = llm.generate([random_prompt(9, 1)], sp, use_tqdm=False)
    ref = llm.generate([random_prompt(9, 1)], greedy(6), use_tqdm=False)[0]
    # at T = 0.01 the top token wins unless another is within ~0.1 logit of it
    assert len(out.token_ids) == 6 and out.token_ids[0] == ref.token_ids[0]
    assert_idle(llm)


# ----------------------------------------------------------------------- submission

def test_params_mutated_after_submission_change_nothing_queued(llm, reference):
    """The issue's scenario: one SamplingParams reused, max_tokens raised for the next request
    after add_request. The first request keeps max_tokens=4, nothing raises."""
    sp = greedy(4)
    prompt_a, prompt_b = random_prompt(20, 2), random_prompt(25, 3)
    rid_a = llm.add_request(prompt_a, sp)
    sp.max_tokens = 30
    sp.stop_token_ids = [9999]  # invalid now: rejected at the next submission ...
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.add_request(prompt_b, sp)
    sp.stop_token_ids = []
    rid_b = llm.add_request(prompt_b, sp)
    outs = drain(llm)
    assert len(outs[rid_a].token_ids) == 4 and len(outs[rid_b].token_ids) == 30
    reference.compare(prompt_a, outs[rid_a].token_ids, 4)
    reference.compare(prompt_b, outs[rid_b].token_ids, 30)
    assert_idle(llm)


@pytest.mark.parametrize("field,value,pattern", [
    ("seed", "12", "seed"), ("seed", 2 ** 70, "seed"), ("logprobs", 2.5, "logprobs"),
    ("temperature", float("nan"), "temperature"), ("max_tokens", -1, "max_tokens"),
    ("top_k", None, "top_k"), ("n", 0, "n must"),
])
def test_values_mutated_to_invalid_are_rejected_at_submission(llm, field, value, pattern):
    sp = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=pattern):
        llm.add_request(random_prompt(10, 4), sp)
    with pytest.raises(ValueError, match=pattern):
        llm.generate([random_prompt(10, 4)], sp, use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("kw,pattern", [
    (dict(logprobs=VOCAB_SIZE + 1), "vocabulary"),
    (dict(logprobs=21), "max_logprobs"), (dict(logprobs=-1), "max_logprobs"),
    (dict(prompt_logprobs=VOCAB_SIZE + 5), "vocabulary"),
    (dict(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(logit_bias={VOCAB_SIZE + 2: 1.0}), "logit_bias"),
    (dict(stop=["w5"]), "tokenizer"), (dict(bad_words=["w5"]), "tokenizer"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty"),
    (dict(structured_outputs={"json": {}}), "structured_outputs must be StructuredOutputsParams"),
    (dict(logprob_token_ids=[1]), "logprob_token_ids"),
])
def test_vocab_bounded_values_are_checked_at_submission(llm, kw, pattern):
    sp = SamplingParams(max_tokens=3, **kw)  # fine without a vocabulary ...
    with pytest.raises(ValueError, match=pattern):  # ... not against this checkpoint's
        llm.add_request(random_prompt(8, 5), sp)
    assert_idle(llm)


def test_whole_vocabulary_logprobs_with_max_logprobs_minus_one(llama_dir):
    llm = make_llm(llama_dir, max_logprobs=-1)
    (out,) = llm.generate([random_prompt(12, 6)], greedy(2, logprobs=-1, prompt_logprobs=-1),
                          use_tqdm=False)
    assert all(len(pos) == VOCAB_SIZE for pos in out.outputs[0].logprobs)
    assert all(len(pos) == VOCAB_SIZE for pos in out.prompt_logprobs[1:])
    total = sum(math.exp(lp.logprob) for lp in out.outputs[0].logprobs[0].values())
    assert total == pytest.approx(1.0, abs=1e-4)
    assert_idle(llm)


def test_seeds_across_the_64_bit_range_run(llm):
    prompt = random_prompt(10, 7)
    for seed in (2 ** 64 - 1, 2 ** 63 + 5, -(2 ** 63)):
        sp = SamplingParams(temperature=1.0, max_tokens=5, seed=seed, ignore_eos=True)
        first = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
        assert llm.generate([prompt], sp, use_tqdm=False)[0].token_ids == first
    assert_idle(llm)


def test_max_tokens_none_runs_to_max_model_len(llm):
    (out,) = llm.generate([random_prompt(100, 8)], SamplingParams(max_tokens=None, ignore_eos=True,
                                                                   temperature=0.0), use_tqdm=False)
    assert len(out.token_ids) == 28 and out.finish_reason == "length"  # 128 - 100
    with pytest.raises(ValueError, match=r"plus the number of requested output tokens"):
        llm.generate([random_prompt(128, 8)], SamplingParams(max_tokens=None), use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("prompt,pattern", [
    ({"prompt_token_ids": [5, 6], "images": []}, "unknown prompt key"),
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": 1}}, "multimodal"),
    ({"cache_salt": "a"}, "needs 'prompt'"),
    ({"prompt_token_ids": [5, 6], "cache_salt": 3}, "cache_salt must be a string"),
    ([[1, 2], [3, 4]], "flat list"), ([1.5, 2.0], "integer token ids"),
])
def test_bad_prompts_are_rejected(llm, prompt, pattern):
    with pytest.raises(ValueError, match=pattern):
        llm.add_request(prompt, greedy(2))
    assert_idle(llm)


def test_a_batch_of_every_feature_never_raises(tokenizer_ckpt):
    """Valid but unusual parameters together in one engine, through preemption and chunked
    prefill: every step runs, every request finishes, the accounting holds after each step."""
    llm = make_llm(tokenizer_ckpt, block_size=8, num_kv_blocks=40, max_num_batched_tokens=24,
                   max_logprobs=-1)
    params = [
        SamplingParams(n=3, temperature=1.3, seed=2 ** 64 - 1, max_tokens=12, logprobs=-1),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.3, repetition_penalty=1.8,
                       presence_penalty=-2.0, frequency_penalty=2.0, max_tokens=15),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}, max_tokens=6, stop=["w5 w5"],
                       include_stop_str_in_output=True, prompt_logprobs=2),
        SamplingParams(allowed_token_ids=[2, 7, 9], min_tokens=5, max_tokens=9, bad_words=["w7"]),
        SamplingParams(temperature=0.9, stop=["w1", "w2", "w3 w4"], min_tokens=3, max_tokens=20,
                       skip_special_tokens=False, detokenize=True, seed=0),
        SamplingParams(temperature=1.0, detokenize=False, logprobs=2, max_tokens=7),
    ]
    rids = [llm.add_request(random_prompt(30 + 7 * i, 20 + i), sp) for i, sp in enumerate(params)]
    outs = drain(llm)
    assert set(outs) == set(rids)
    assert len(outs[rids[0]].outputs) == 3
    assert outs[rids[2]].outputs[0].token_ids[:1] == [5]
    assert set(outs[rids[3]].outputs[0].token_ids) <= {2, 7, 9} and 7 not in outs[rids[3]].outputs[0].token_ids
    assert len(outs[rids[3]].outputs[0].token_ids) >= 5
    assert outs[rids[5]].outputs[0].text == ""  # vLLM: "" with detokenize=False
    assert_idle(llm)


# ----------------------------------------------------------------------- EOS

def _eos_checkpoint(llama_dir, tmp_path, generation_config: dict | None, config_eos: int):
    d = tmp_path / "eos"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (d / "config.json").write_text(json.dumps(cfg))
    gen = d / "generation_config.json"
    if generation_config is None:
        gen.unlink(missing_ok=True)
    else:
        gen.write_text(json.dumps(generation_config))
    return d


def test_eos_comes_from_generation_config_only_when_it_exists(llama_dir, tmp_path, reference):
    prompt = random_prompt(20, 30)
    ref = reference.get(prompt, 12)
    k = next(i for i in range(2, ref.first_tie(12)) if ref.tokens[i] not in ref.tokens[:i])
    eos = ref.tokens[k]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    # generation_config.json without eos_token_id: no EOS at all (config.json's is not used)
    no_eos = make_llm(_eos_checkpoint(llama_dir, tmp_path / "a", {"bos_token_id": 1}, eos))
    (out,) = no_eos.generate([prompt], sp, use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    # no generation_config.json: config.json's eos stops generation
    from_config = make_llm(_eos_checkpoint(llama_dir, tmp_path / "b", None, eos))
    (out,) = from_config.generate([prompt], sp, use_tqdm=False)
    assert out.finish_reason == "stop" and out.token_ids == ref.tokens[:k + 1]
    assert out.outputs[0].stop_reason is None  # EOS: no stop_reason, as vLLM


# ----------------------------------------------------------------------- failure isolation

def test_a_failing_detokenizer_fails_its_request_alone(tokenizer_ckpt, reference):
    llm = make_llm(tokenizer_ckpt, block_size=8)
    real_decode = llm.tokenizer.decode
    bad = {"armed": True}

    def decode(ids, *args, **kwargs):
        if bad["armed"] and 300 in list(ids):  # any window holding token 300 fails
            raise RuntimeError("broken tokenizer")
        return real_decode(ids, *args, **kwargs)

    llm.tokenizer.decode = decode
    prompts = [random_prompt(12, 40 + i) for i in range(4)]
    sps = [greedy(8, logit_bias={300: 100.0}) if i == 1 else greedy(8) for i in range(4)]
    rids = [llm.add_request(p, sp) for p, sp in zip(prompts, sps)]
    with pytest.warns(UserWarning, match="could not decode"):
        outs = drain(llm)
    failed = outs[rids[1]]
    assert failed.finish_reason == "error" and not failed.text and failed.token_ids == [300]
    for i in (0, 2, 3):
        assert outs[rids[i]].finish_reason == "length" and outs[rids[i]].text
        reference.compare(prompts[i], outs[rids[i]].token_ids, 8)
    check_accounting(llm)
    assert_idle(llm)
