"""The compiled few-row bfloat16 linear (fast/csrc/small_linear.cpp) that decode steps of a few
sequences use: as close to the float32 product as bfloat16's own linear is, with and without
bias, a fused silu(gate) * up, widths with a tail, and the packed linears' dispatch by rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fast.kernels import compiled_kernels
from fast.linear import SMALL_ROWS, PackedLinear, PackedSiluMLP
from model import MLP, Linear


@pytest.fixture(scope="module")
def small():
    module = compiled_kernels().module
    assert module is not None, compiled_kernels().reason  # g++ is on every machine this project uses
    if not module.small_linear_available():
        pytest.skip("this CPU has no AVX-512 BF16: the few-row linear is not built here")
    return module.small_linear


def reference(x, weight, bias, silu_mul):
    """float32 product of the bfloat16 inputs (gate and up stacked when silu_mul)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def bf16_own_error(x, weight, bias, silu_mul):
    """bfloat16's own error: PyTorch's bfloat16 linear (and activation) against float32."""
    y = F.linear(x, weight, bias)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return (y.float() - reference(x, weight, bias, silu_mul)).abs().mean()


@pytest.mark.parametrize("rows", range(1, SMALL_ROWS + 1))
@pytest.mark.parametrize("in_features", [1024, 72, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_small_linear_is_as_close_as_bfloat16s_own(small, rows, in_features, bias, silu_mul):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = (torch.randn(96, in_features, generator=g) * in_features ** -0.5).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 2 * in_features, generator=g).bfloat16()[:, ::2]  # not contiguous
    got = small(x, weight, b, silu_mul)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48 if silu_mul else 96)
    error = (got.float() - reference(x, weight, b, silu_mul)).abs().mean()
    assert error <= 1.25 * bf16_own_error(x, weight, b, silu_mul) + 1e-6


def test_small_linear_refuses_what_it_does_not_compute(small):
    weight = torch.randn(8, 32).bfloat16()
    with pytest.raises(RuntimeError, match="at most 4 rows"):
        small(torch.randn(SMALL_ROWS + 1, 32).bfloat16(), weight)
    with pytest.raises(RuntimeError, match="bfloat16"):
        small(torch.randn(1, 32), weight.float())


def test_packed_layers_take_the_small_linear_for_a_few_rows_only(small):
    """PackedLinear / PackedSiluMLP call it for up to SMALL_ROWS rows, oneDNN beyond; both
    paths agree with the float32 product to bfloat16's error."""
    calls = []
    def counted(*args):
        calls.append(args[0].shape[0])
        return small(*args)
    torch.manual_seed(0)
    linear = Linear(64, 48).bfloat16()
    mlp = MLP(SimpleNamespace(hidden_act="silu", hidden_size=64, intermediate_size=48, mlp_bias=True)).bfloat16()
    linear.replacement, mlp.replacement = PackedLinear(counted), PackedSiluMLP(counted)
    mlp.down_proj.replacement = PackedLinear(counted)
    for rows in (1, SMALL_ROWS, SMALL_ROWS + 1, 16):
        x = torch.randn(rows, 64).bfloat16()
        with torch.inference_mode():
            got, got_mlp = linear(x), mlp(x)
            gate, up = F.linear(x.float(), mlp.gate_up_proj.weight.float(), mlp.gate_up_proj.bias.float()).chunk(2, -1)
            want_mlp = F.linear(F.silu(gate) * up, mlp.down_proj.weight.float(), mlp.down_proj.bias.float())
        torch.testing.assert_close(got.float(), F.linear(x.float(), linear.weight.float(), linear.bias.float()),
                                   atol=0.05, rtol=0.05)
        torch.testing.assert_close(got_mlp.float(), want_mlp, atol=0.05, rtol=0.05)
    assert calls == [1, 1, 1, SMALL_ROWS, SMALL_ROWS, SMALL_ROWS]  # linear; MLP's gate_up and down
