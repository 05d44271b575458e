"""Prompts longer than one step's token budget, on every path, in bfloat16 and float32.

A prompt past the budget is prefilled in chunks, and a step that holds only such a chunk
samples nothing: its LM head sees no rows. That empty input once crashed the default bfloat16
path (the few-row kernel took it for four rows, issue 45) for every prompt past 2,048 tokens.
Here: prompts past 2,048, past 4,096 and to 8,000 tokens, budgets that do not divide them,
block sizes 1, 16 and 64, odd head counts; every path's tokens equal the plain path's (in
bfloat16 up to the plain path's first near-tie, where the two may rightly part).
"""
from __future__ import annotations

import functools

import pytest

from helpers import build_checkpoint, make_llm, random_prompt
from engine import SamplingParams

NEW = 4
# Group 3 (6 query heads over 2), a head size with a vector tail; q/k norms (Qwen3) run the
# norm-and-RoPE kernel; room for 8,000 tokens and the new ones.
SHAPE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=8192 + 64)
PATHS = {"plain": dict(fast_paths=False), "eager": dict(enforce_eager=True), "kernels": {},
         "int8": dict(quantization="int8"), "int8_plain": dict(quantization="int8", fast_paths=False)}
TIE = 0.02  # bfloat16 logits closer than this: either token is right


@pytest.fixture(scope="module")
def long_qwen3(tmp_path_factory) -> str:
    return build_checkpoint("qwen3", str(tmp_path_factory.mktemp("long_qwen3")), **SHAPE)


POOL_TOKENS = 32768  # every prompt of a test at once


def generate(ckpt: str, *batches: list[list[int]], block_size: int = 16, **settings):
    """Each batch in turn on one engine (a later batch can hit what an earlier one cached):
    the outputs, in order."""
    llm = make_llm(ckpt, max_model_len=8192 + 64, block_size=block_size,
                   num_kv_blocks=POOL_TOKENS // block_size, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    return [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]


def assert_same_greedy(got, want, what: str) -> None:
    """Equal tokens up to the reference's first near-tie (top-2 logprobs within TIE)."""
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        top = sorted((lp.logprob for lp in want.logprobs[i].values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < TIE:
            return
        assert a == b, f"{what}: token {i} differs ({got.token_ids} vs {want.token_ids})"


LONG_PROMPTS = [random_prompt(n, seed=n) for n in (2100, 4200, 8000)]


@functools.cache
def long_outputs(ckpt: str, dtype: str, path: str) -> list:
    return [o.outputs[0] for o in generate(ckpt, LONG_PROMPTS, dtype=dtype, **PATHS[path])]


@pytest.mark.parametrize("path", ["plain", "eager", "kernels", "int8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prompts_past_2048_and_4096_on_every_path(long_qwen3, path, dtype):
    """Against the plain path of the same weight format (int8's plain path dequantizes)."""
    prompts = LONG_PROMPTS
    plain = long_outputs(long_qwen3, dtype, "int8_plain" if path == "int8" else "plain")
    got = long_outputs(long_qwen3, dtype, path)
    for prompt, a, b in zip(prompts, got, plain):
        assert len(a.token_ids) == NEW
        if dtype == "float32":
            assert a.token_ids == b.token_ids, f"{path}, {len(prompt)} tokens"
        else:
            assert_same_greedy(a, b, f"{path} {dtype}, {len(prompt)} tokens")


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_chunk_budgets_that_divide_nothing_with_a_cached_prefix(long_qwen3, block_size):
    """Budgets of 1,000 and 777 tokens over a 3,000-token prefix that is then hit in the cache,
    the follow-up's chunk starting inside a block; bfloat16 kernels against the plain path."""
    prefix = random_prompt(3000, seed=1)
    prompts = [prefix + random_prompt(n, seed=n) for n in (5, 1234)]
    for budget in (1000, 777):
        settings = dict(dtype="bfloat16", block_size=block_size, max_num_batched_tokens=budget)
        plain = generate(long_qwen3, [prefix], prompts, fast_paths=False, **settings)
        got = generate(long_qwen3, [prefix], prompts, **settings)
        for a, b in zip(got, plain):
            assert_same_greedy(a.outputs[0], b.outputs[0], f"block {block_size}, budget {budget}")
        assert [o.num_cached_tokens for o in got[1:]] == [3000 // block_size * block_size] * 2
