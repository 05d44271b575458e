"""Tests of the shipped demo checkpoint in demo_model/ (CPU, no network).

The demo model memorised passages of the Python reference, so greedy decoding
of its demo prompts must give back the reference text. These tests check that
with Hugging Face ``generate`` and with the engine, including the engine under
memory pressure (eviction, preemption, chunked prefill, prefix-cache hits).
The checkpoint is made by ``python tools/train_demo_model.py --out demo_model``.
"""
from __future__ import annotations

import json
import os

import pytest

from helpers import GreedyReference, greedy, make_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_DIR = os.path.join(ROOT, "demo_model")
CHECK = 20          # tokens each demo prompt must reproduce
MIN_PROMPTS = 8
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def demo() -> dict:
    path = os.path.join(DEMO_DIR, "prompts.json")
    assert os.path.isfile(path), "demo_model/ is missing: run python tools/train_demo_model.py --out demo_model"
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def prompt_ids(demo) -> list[list[int]]:
    return [p["prompt_ids"] for p in demo["prompts"]]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids) -> list[list[int]]:
    """HF greedy continuation (CHECK tokens) of every demo prompt, one at a time."""
    reference = GreedyReference(DEMO_DIR)
    return [reference.get(ids, CHECK).tokens for ids in prompt_ids]


def _demo_llm(**overrides):
    return make_llm(DEMO_DIR, **{**dict(block_size=BLOCK_SIZE, max_num_seqs=8), **overrides})


# ---------------------------------------------------------------- checkpoint

def test_checkpoint_is_small_standard_llama(demo):
    with open(os.path.join(DEMO_DIR, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(DEMO_DIR, name)), name
    size = sum(os.path.getsize(os.path.join(DEMO_DIR, n)) for n in os.listdir(DEMO_DIR))
    assert size <= 20 * 2**20
    assert len(demo["prompts"]) >= MIN_PROMPTS


def test_tokenizer_round_trips_demo_prompts(demo):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO_DIR)
    for p in demo["prompts"]:
        assert p["prompt"].startswith(demo["shared_prefix"])
        # A text prompt encodes (BOS included) to exactly the stored ids.
        assert tok(p["prompt"])["input_ids"] == p["prompt_ids"]
        assert tok.decode(p["expected_ids"]) == p["expected"]
    assert " statement " in tok.decode(demo["prompts"][0]["prompt_ids"], skip_special_tokens=True)


# ---------------------------------------------------------------- HF only

def test_hf_greedy_reproduces_reference_text(demo, hf_greedy):
    expected = [p["expected_ids"][:CHECK] for p in demo["prompts"]]
    matches = [got == want for got, want in zip(hf_greedy, expected)]
    assert sum(matches) >= MIN_PROMPTS
    assert all(matches), [p["topic"] for p, ok in zip(demo["prompts"], matches) if not ok]


# ---------------------------------------------------------------- engine

def test_engine_matches_hf_under_memory_pressure(prompt_ids, hf_greedy):
    # The pool holds the largest single request, but nowhere near all of them.
    per_request = max(-(-(len(ids) + CHECK - 1) // BLOCK_SIZE) for ids in prompt_ids)
    num_blocks = per_request + 4
    shared_blocks = len(os.path.commonprefix(prompt_ids)) // BLOCK_SIZE
    all_at_once = shared_blocks + sum(-(-(len(ids) + CHECK) // BLOCK_SIZE) - shared_blocks
                                      for ids in prompt_ids)
    assert all_at_once > num_blocks
    llm = _demo_llm(num_kv_blocks=num_blocks, max_num_batched_tokens=64)

    first = llm.generate(prompt_ids, greedy(CHECK), use_tqdm=False)
    assert [o.token_ids for o in first] == hf_greedy
    after_first = llm.stats()
    assert after_first["blocks_in_use"] == 0
    assert after_first["preemptions"] > 0
    assert after_first["evictions"] > 0

    # Second round: the shared prefix is served from the cache.
    second = llm.generate(prompt_ids, greedy(CHECK), use_tqdm=False)
    assert [o.token_ids for o in second] == hf_greedy
    after_second = llm.stats()
    assert after_second["blocks_in_use"] == 0
    assert after_second["prefix_cache_hits"] > after_first["prefix_cache_hits"]


def test_engine_reproduces_reference_text(demo):
    llm = _demo_llm(num_kv_blocks=512)
    # Text prompts, as the demo sends them: the engine's tokenizer must add BOS.
    outs = llm.generate([p["prompt"] for p in demo["prompts"]], greedy(CHECK), use_tqdm=False)
    matches = [o.token_ids == p["expected_ids"][:CHECK] for o, p in zip(outs, demo["prompts"])]
    assert sum(matches) >= MIN_PROMPTS
    assert all(matches), [p["topic"] for p, ok in zip(demo["prompts"], matches) if not ok]
    for o, p in zip(outs, demo["prompts"]):
        assert o.text == llm.tokenizer.decode(p["expected_ids"][:CHECK], skip_special_tokens=True)
    assert llm.stats()["blocks_in_use"] == 0
