"""The compiled kernels' limits are checked where the path is chosen (fast/paths.py), not hit
inside a step: at each limit the kernel runs (where this CPU builds it), one past it the PyTorch
kind does, and either way the default engine gives Hugging Face's tokens."""
from __future__ import annotations

import pytest
import torch

from fast.kernels import compiled_kernels
from fast.paths import INT32_MAX, TILE_MAX_GROUP, choose_paths
from helpers import MAX_POS, GreedyReference, build_checkpoint, greedy, make_llm, random_prompt
from model import ModelConfig

CPU = torch.device("cpu")


def tiles_built() -> bool:
    build = compiled_kernels()
    assert build.module is not None, build.reason  # g++ is on every machine this project uses
    return build.module.prefill_attention_available()


def chosen(checkpoint_dir: str, dtype=torch.float32):
    from transformers import AutoConfig
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(checkpoint_dir))
    return choose_paths(config, dtype, CPU, enforce_eager=False)


def assert_hf_tokens(checkpoint_dir: str, prompt_lengths=(40, 9)) -> None:
    """A shared cached prefix (prompt chunks after it, decode rows sharing it) and a lone prompt."""
    prefix = random_prompt(prompt_lengths[0], seed=3)
    prompts = [prefix + random_prompt(n, seed=n) for n in (2, 7, 11)] + [random_prompt(prompt_lengths[1], seed=4)]
    llm = make_llm(checkpoint_dir, block_size=8)
    llm.generate([prefix], greedy(1), use_tqdm=False)
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    GreedyReference(checkpoint_dir).compare_all(prompts, [o.outputs[0] for o in outs], 8)


@pytest.mark.parametrize("heads", [TILE_MAX_GROUP, TILE_MAX_GROUP + 1])
def test_query_heads_per_kv_head_at_and_past_the_tile_limit(tmp_path, heads):
    """A Qwen3 with 16 query heads over one KV head takes the tile kernels; 17 (once a
    RuntimeError inside prefill_attention) takes the PyTorch kinds."""
    ckpt = build_checkpoint("qwen3", str(tmp_path), num_attention_heads=heads, num_key_value_heads=1,
                            head_dim=16)
    paths = chosen(ckpt)
    on = heads <= TILE_MAX_GROUP and tiles_built()
    assert (paths.routes.shared_decode_kernel is not None) == on, paths.describe()
    assert (paths.routes.prefill_kernel is not None) == on, paths.describe()
    if heads > TILE_MAX_GROUP and tiles_built():
        assert f"{heads} query heads per KV head (at most {TILE_MAX_GROUP})" in paths.describe()
    assert paths.routes.decode_kernel is not None  # the decode kernel takes any group
    assert_hf_tokens(ckpt)


@pytest.mark.parametrize("past", [0, 1])
def test_a_window_at_and_past_the_int32_positions_of_the_tiles(tmp_path, past):
    """The tile kernels compare position + window in int32: a window that fits with the last
    position takes them, one more keeps the PyTorch kinds; tokens are HF's near the last position."""
    window = INT32_MAX - MAX_POS + past
    ckpt = build_checkpoint("mistral", str(tmp_path), sliding_window=window)
    paths = chosen(ckpt)
    on = not past and tiles_built()
    assert (paths.routes.prefill_kernel is not None) == on, paths.describe()
    if past and tiles_built():
        assert "past int32" in paths.describe()
    assert_hf_tokens(ckpt, prompt_lengths=(MAX_POS - 30, 9))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtypes_outside_the_kernels_keep_pytorch(checkpoints, dtype):
    """float64: no kernel at all (their softmax is float32); bfloat16: the kernels, prompt
    chunks included (one recipe with decode rows), the few-row linear where AVX-512 BF16 is."""
    paths = chosen(checkpoints["llama"], dtype)
    if dtype == torch.float64:
        assert paths.build is None and paths.glue is None and paths.routes.decode_kernel is None
        assert "float64 is not theirs" in paths.describe()
    else:
        assert paths.routes.decode_kernel is not None
        assert (paths.routes.prefill_kernel is not None) == tiles_built(), paths.describe()
        small = compiled_kernels().module.small_linear_available()
        assert (paths.small_linear is not None) == small, paths.describe()
