"""Bad input is rejected with a clear exception, and never corrupts the engine."""
from __future__ import annotations

import contextlib
import json
import shutil
import signal

import pytest
import torch

from engine import SamplingParams, VLLMValidationError
from helpers import VOCAB_SIZE, GreedyReference, assert_no_leak, greedy, make_llm, random_prompt


@pytest.fixture(scope="module")
def llm(llama_dir):
    """One shared engine: every bad request below must leave it usable."""
    return make_llm(llama_dir, block_size=16, max_model_len=128)


@contextlib.contextmanager
def hang_guard(seconds=120):
    """Turn an infinite loop into a test failure instead of a hung suite."""
    def on_alarm(signum, frame):
        raise AssertionError(f"engine did not return within {seconds}s (infinite loop?)")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _still_works(llm, model_dir):
    prompt = random_prompt(11, 7)
    outs = llm.generate([prompt], greedy(6), use_tqdm=False)
    assert len(outs) == 1 and outs[0].finish_reason == "length"
    GreedyReference(model_dir).compare_all([prompt], outs, 6)
    assert_no_leak(llm)


# ------------------------------------------------------------------- prompts

def test_empty_prompt(llm):  # vLLM's tests/entrypoints/llm/test_prompt_validation.py
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm.generate([[]], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="(?i)empty"):
        llm.add_request([], greedy(4))
    assert_no_leak(llm)


@pytest.mark.parametrize("bad_id", [-1, VOCAB_SIZE, VOCAB_SIZE + 100])
def test_token_id_out_of_vocab(llm, bad_id):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[5, 6, bad_id, 7]], greedy(4), use_tqdm=False)
    assert_no_leak(llm)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="cannot pass text prompts when `skip_tokenizer_init=True`"):
        llm.generate(["hello world"], greedy(4), use_tqdm=False)


def test_skip_tokenizer_init_as_vllms_test(tokenizer_ckpt):
    """vLLM's tests/entrypoints/llm test of skip_tokenizer_init, with only the model changed."""
    llm = make_llm(tokenizer_ckpt, skip_tokenizer_init=True)
    sampling_params = SamplingParams(prompt_logprobs=True, detokenize=True)
    with pytest.raises(ValueError, match="cannot pass text prompts when"):
        llm.generate("abc", sampling_params)
    outputs = llm.generate({"prompt_token_ids": [1, 2, 3]}, sampling_params=sampling_params)
    completions = outputs[0].outputs
    assert completions[0].text == "" and len(completions[0].token_ids) > 0


def test_max_model_len_caps_a_request_as_vllm_does(llm):
    # max_model_len=128: 120 + 32 runs, stopped at the limit with "length" (vLLM's V1 scheduler)
    (out,) = llm.generate([random_prompt(120, 1)], SamplingParams(temperature=0.0, max_tokens=32,
                                                                  ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 8 and out.outputs[0].finish_reason == "length"
    with pytest.raises(VLLMValidationError, match=r"^This model's maximum context length is 128 "
                       r"tokens\. However, your prompt contains 200 input tokens, which exceeds"):
        llm.generate([random_prompt(200, 1)], greedy(1), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match=r"^The decoder prompt \(length 128\) plus the "
                       r"number of requested output tokens \(at least 1\) is longer than the "
                       r"maximum model length of 128\."):
        llm.generate([random_prompt(128, 1)], greedy(1), use_tqdm=False)
    assert_no_leak(llm)


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="(?i)sampling_params|prompts"):
        llm.generate([[1, 2, 3], [4, 5]], [greedy(4)], use_tqdm=False)


# ------------------------------------------------------------ sampling params

@pytest.mark.parametrize("kw,pattern", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_sampling_params(llm, kw, pattern):
    # may be raised when SamplingParams is built or when generate() sees it
    with pytest.raises(ValueError, match=pattern):
        llm.generate([[1, 2, 3]], SamplingParams(**kw), use_tqdm=False)
    assert_no_leak(llm)


def test_valid_edge_sampling_params_are_accepted():
    SamplingParams(top_p=1.0, top_k=-1, temperature=0.0, max_tokens=1)
    SamplingParams(top_k=0)  # vLLM's default: top-k off
    SamplingParams(top_p=1e-9, top_k=1)


# -------------------------------------------------------------- engine args

def test_block_size_below_one(llama_dir):
    for bs in (0, -4):
        with pytest.raises(ValueError, match="block_size"):
            make_llm(llama_dir, block_size=bs)


def test_kv_budget_too_small_for_one_block(llama_dir):
    with pytest.raises(ValueError, match="(?i)kv|block|small"):
        make_llm(llama_dir, kv_cache_memory=10)


def test_checkpoint_dir_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="(?i)not exist|no such|not found"):
        make_llm(tmp_path / "no_such_model")


def test_checkpoint_without_weights(llama_dir, tmp_path):
    d = tmp_path / "config_only"
    d.mkdir()
    shutil.copy(f"{llama_dir}/config.json", d / "config.json")
    with pytest.raises(FileNotFoundError, match="(?i)safetensors|weights"):
        make_llm(d)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    d = tmp_path / "gpt2"
    GPT2LMHeadModel(cfg).save_pretrained(d)
    assert json.loads((d / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="(?i)GPT2|architecture|support"):
        make_llm(d)


# -------------------------------------------------------------- robustness

def test_bad_request_among_good_ones_leaves_engine_clean(llm, llama_dir):
    good = [random_prompt(20, 2), random_prompt(37, 3)]
    with pytest.raises(ValueError, match="(?i)empty"):
        llm.generate([good[0], [], good[1]], greedy(5), use_tqdm=False)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="(?i)vocab"):
        llm.generate([good[0], good[1], [1, VOCAB_SIZE]], greedy(5), use_tqdm=False)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(good, [greedy(5), SamplingParams(top_p=0.0)], use_tqdm=False)
    assert_no_leak(llm)
    # nothing of the failed calls is still queued: exactly the new requests come back
    outs = llm.generate(good, greedy(5), use_tqdm=False)
    assert len(outs) == 2
    GreedyReference(llama_dir).compare_all(good, outs, 5)
    assert_no_leak(llm)
    assert not llm.step()
    _still_works(llm, llama_dir)


def test_request_that_can_never_fit_the_pool_raises(llama_dir):
    # 3 blocks of 8 tokens = 24 slots; a 40-token prompt can never be scheduled
    small = make_llm(llama_dir, block_size=8, num_kv_blocks=3)
    with hang_guard():
        with pytest.raises(ValueError, match="(?i)block|pool|fit|capacity"):
            small.generate([random_prompt(40, 4)], greedy(4), use_tqdm=False)
        with pytest.raises(ValueError, match="(?i)block|pool|fit|capacity"):
            small.add_request(random_prompt(20, 5), greedy(10))  # 29 slots needed > 24
        assert_no_leak(small)
        # a request that fits alone still runs (one after another if needed)
        prompts = [random_prompt(12, 6), random_prompt(15, 7)]
        outs = small.generate(prompts, greedy(6), use_tqdm=False)
    GreedyReference(llama_dir).compare_all(prompts, outs, 6)
    assert_no_leak(small)


@pytest.mark.parametrize("kw, pattern", [
    (dict(n=10**9, temperature=1.0), "n must be at most 16384, got 1000000000"),
    (dict(n=16385, temperature=1.0), "n must be at most 16384"),
    (dict(stop=["x"] * 1025), "stop holds 1025 strings, at most 1024"),
    (dict(stop=["x" * 10**6]), "a stop string of 1000000 characters"),
    (dict(bad_words=[f"w{i}" for i in range(1025)]), "bad_words holds 1025 words"),
    (dict(stop_token_ids=list(range(2**20 + 1))), "stop_token_ids holds 1048577 entries"),
    (dict(allowed_token_ids=[1] * (2**20 + 1)), "allowed_token_ids holds 1048577 entries"),
    (dict(logprobs=10**9), "logprobs=1000000000 exceeds the vocabulary size"),
    (dict(prompt_logprobs=10**9), "prompt_logprobs=1000000000 exceeds the vocabulary size"),
])
def test_every_per_request_fan_out_is_bounded(llm, kw, pattern):
    """What one request may fan out to (sequences, list entries, stop strings) is refused past its
    bound before anything is built from it, and the engine stays usable."""
    with hang_guard(60), pytest.raises(ValueError, match=pattern):
        llm.generate([[1, 2, 3]], SamplingParams(**kw), use_tqdm=False)
    assert_no_leak(llm)
    SamplingParams(n=16384, temperature=1.0, stop=["x"] * 1024)  # the bounds themselves are taken


def test_beam_width_is_bounded_as_n_is():
    from vllm_api.beam import BeamSearchParams
    with pytest.raises(ValueError, match="beam_width must be at most 16384"):
        BeamSearchParams(beam_width=10**9, max_tokens=4)
