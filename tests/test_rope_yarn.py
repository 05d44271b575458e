"""YaRN RoPE (``rope_type: "yarn"``, as Qwen3 configs set it for long context): the tables equal
Hugging Face's for every parameter YaRN reads, and greedy tokens equal HF ``generate`` on tiny
random Qwen3 and Llama checkpoints, by the default (compiled kernels) and the plain path."""
from __future__ import annotations

import pytest
import torch

from helpers import GreedyReference, build_checkpoint, checkpoint_config, greedy, make_llm, random_prompt
from model import RotaryEmbedding, _rope_parameters, rope_inv_freq

# original_max_position_embeddings far below the prompts' positions, so the interpolated
# dimensions decide the tokens.
YARN = dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=64)
PARAMETER_SETS = {
    "factor": {},
    "attention_factor": dict(attention_factor=0.8),
    "mscale": dict(mscale=1.0, mscale_all_dim=0.5),
    "betas": dict(beta_fast=16, beta_slow=2, factor=8.0),
    "untruncated": dict(truncate=False, factor=3.0, original_max_position_embeddings=77),
}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("extra", PARAMETER_SETS.values(), ids=PARAMETER_SETS.keys())
def test_yarn_tables_equal_hf(arch, extra):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = checkpoint_config(arch, rope_parameters={**YARN, **extra})
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    params = _rope_parameters(hf)
    head_dim = hf.head_dim
    got_freq, got_scale = rope_inv_freq(head_dim, params, hf.max_position_embeddings)
    assert torch.equal(got_freq, want_freq)
    assert got_scale == pytest.approx(want_scale, rel=1e-12) and got_scale != 1.0
    table = RotaryEmbedding(head_dim, params, hf.max_position_embeddings)
    assert table.cos.abs().max() > 1.0 or want_scale < 1.0  # the scale reaches the table


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'.*yarn"):
        rope_inv_freq(32, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 512)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def yarn_ckpt(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(f"yarn_{request.param}")
    return build_checkpoint(request.param, str(out), rope_parameters=dict(YARN))


@pytest.mark.parametrize("path", [dict(), dict(fast_paths=False), dict(enforce_eager=True)],
                         ids=["default", "plain", "eager"])
def test_yarn_tokens_equal_hf(yarn_ckpt, path):
    llm = make_llm(yarn_ckpt, **path)
    backend = llm.llm_engine.engine_core.model_runner.backend
    # The default path rotates by the compiled norm + RoPE kernel, from model.py's tables.
    assert (getattr(backend, "kernels", None) is not None) == (path == {}), backend.describe()
    prompts = [random_prompt(n, seed=n) for n in (9, 70, 150)]  # below and past 64 positions
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    GreedyReference(yarn_ckpt).compare_all(prompts, outs, 12, min_fraction=0.8)

