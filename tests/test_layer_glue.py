"""The compiled layer glue (fast/csrc/layer_glue.cpp, fast/glue.py): RMSNorm and each head's
norm + RoPE give model.py's values (rounded as it rounds them, in every dtype the kernels take),
on strided inputs; through model.py's seam they replace exactly model.py's own norms and
rotations, on the model's own parameters."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fast.glue import KernelRMSNorm, KernelRotation, glue_replacements
from fast.kernels import compiled_kernels
from model import HeadRotation, RMSNorm, RotaryEmbedding, apply_rope, load_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: the sum of squares in another order; half precision: that, seen through one rounding.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="module")
def kernels():
    build = compiled_kernels()
    assert build.module is not None, build.reason  # g++ is on every machine this project uses
    return build.module


def norm(dim: int, dtype, seed: int) -> RMSNorm:
    module = RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return module


def rope(tokens: int, head_dim: int, dtype):
    table = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return table.lookup(positions, dtype)


def assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Close; in half precision also equal but for a few elements that one rounding flipped
    (float32's normaliser may differ in its last bit, so every element may)."""
    torch.testing.assert_close(got, want, **TOLERANCE[got.dtype])
    if got.dtype != torch.float32:
        assert (got != want).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 1024), (7, 72), (300, 64)])
def test_rms_norm_is_model_rmsnorm(kernels, dtype, rows, dim):
    x = (torch.randn(rows, 2 * dim) * 3).to(dtype)[:, :dim]  # rows strided, as after a split
    module = norm(dim, dtype, seed=rows)
    got, want = kernels.rms_norm(x, module.weight, module.eps), module(x)
    assert got.dtype == dtype and got.shape == want.shape
    assert_rounded_alike(got, want)


@pytest.mark.parametrize("shape", [(24,), (2, 3, 4, 24), "transposed"])
def test_rms_norm_takes_any_layout(kernels, shape):
    x = torch.randn(24, 5).t() if shape == "transposed" else torch.randn(shape)
    module = norm(x.shape[-1], torch.float32, seed=1)
    got = kernels.rms_norm(x, module.weight, module.eps)
    assert got.shape == x.shape
    assert_rounded_alike(got, module(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 16, 128), (5, 3, 64), (33, 2, 18)])
def test_norm_rope_is_model_norm_then_rope(kernels, dtype, with_norm, tokens, heads, head_dim):
    packed = torch.randn(tokens, heads * head_dim + 40).to(dtype)  # q's part of a qkv row
    x = packed[:, : heads * head_dim].view(tokens, heads, head_dim)
    module = norm(head_dim, dtype, seed=heads) if with_norm else None
    cos, sin = rope(tokens, head_dim, dtype)
    want = apply_rope(module(x) if with_norm else x, cos, sin)
    weight, eps = (module.weight, module.eps) if with_norm else (None, 0.0)
    got = kernels.norm_rope(x, weight, eps, cos[:, 0], sin[:, 0])
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    assert_rounded_alike(got, want)


def test_glue_refuses_what_it_does_not_compute(kernels):
    with pytest.raises(RuntimeError, match="weight \\[D\\] of x's dtype"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="even D"):
        kernels.norm_rope(torch.randn(2, 1, 7), None, 0.0, torch.ones(2, 7), torch.ones(2, 3))


def test_glue_replaces_every_norm_and_rotation_of_the_model(kernels, checkpoints):
    model = load_model(checkpoints["qwen3"], torch.float32, torch.device("cpu"))
    replacements = glue_replacements(model, kernels)
    parts = dict(model.named_modules())
    assert {n for n, r in replacements.items() if isinstance(r, KernelRotation)} == \
        {n for n, m in parts.items() if isinstance(m, HeadRotation)}
    assert {n for n, r in replacements.items() if isinstance(r, KernelRMSNorm)} == \
        {n for n, m in parts.items() if isinstance(m, RMSNorm)}
    x = torch.randn(3, model.config.hidden_size)
    want = model.norm(x)
    model.install(replacements)
    assert_rounded_alike(model.norm(x), want)
    assert model.norm.replacement is replacements["norm"]


def test_glue_leaves_a_norm_that_computes_something_else(kernels, checkpoints):
    class OffsetNorm(RMSNorm):  # a (1 + weight) norm, as some architectures have
        def compute(self, x):
            return super().compute(x) + x

    model = load_model(checkpoints["llama"], torch.float32, torch.device("cpu"))
    model.norm = OffsetNorm(model.config.hidden_size, 1e-6)
    replacements = glue_replacements(model, kernels)
    assert "norm" not in replacements and "layers.0.input_layernorm" in replacements
    model.install(replacements)
    assert model.norm.replacement is None
