"""The decode kernels' work over several threads (fast/csrc/balance.h): each thread owns a
contiguous range of weight-row groups (or attention heads) and a thread done early takes the
others' items from the back. Every item must be computed exactly once and by the same math
whichever thread takes it, so the outputs are the same bits at 1, 2, 3 and 5 threads, for
item counts below, at and above the thread count. The suite otherwise runs on one thread
(conftest.py), where no item is ever taken by another thread.
"""
from __future__ import annotations

import pytest
import torch

from core.int4_format import interleave_q4_0, quantize_q4_0
from core.q8_0_format import quantize_q8_0
from fast.kernels import compiled_kernels

THREADS = (2, 3, 5)


@pytest.fixture(scope="module")
def kernels():
    module = compiled_kernels().module
    assert module is not None, compiled_kernels().reason
    return module


@pytest.fixture
def at_threads():
    """Runs fn at each thread count (torch's intra-op threads), back to one after."""
    def run(fn):
        out = {}
        try:
            for t in (1,) + THREADS:
                torch.set_num_threads(t)
                out[t] = fn()
        finally:
            torch.set_num_threads(1)
        return out
    return run


def assert_same_bits(outs: dict) -> None:
    for t in THREADS:
        assert torch.equal(outs[t], outs[1]), f"{t} threads"


# 16 rows make a lane group, 32 a few-row task: one group (fewer items than threads), a few,
# many with a short last one.
ROWS = [16, 48, 208, 1000]


@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("fmt", [4, 8, 1])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_lane_linear_is_the_same_bits_at_any_thread_count(kernels, at_threads, n, fmt, m, silu_mul):
    if not kernels.lane_linear_available():
        pytest.skip("this CPU has no AVX-512 VNNI: lane_linear is not built here")
    torch.manual_seed(n + fmt + m)
    if fmt == 4 and silu_mul:
        n = n // 16 * 16  # a Q4_0 gate/up pair's up rows start a group
    k, rows = 96, 2 * n if silu_mul else n
    if fmt == 4:
        weight, scale = interleave_q4_0(*quantize_q4_0(torch.randn(rows, k)))
    elif fmt == 8:
        weight, scale = quantize_q8_0(torch.randn(rows, k))
    else:
        weight, scale = torch.randint(-127, 128, (rows, k), dtype=torch.int8), torch.rand(rows) * 0.01
    x = torch.randn(m, k).bfloat16()
    assert_same_bits(at_threads(lambda: kernels.lane_linear(x, weight, scale, None, fmt, silu_mul)))


@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_int8_linear_is_the_same_bits_at_any_thread_count(kernels, at_threads, n, dtype, silu_mul):
    if not kernels.int8_linear_available():
        pytest.skip("this CPU has no AVX-512: int8_linear is not built here")
    torch.manual_seed(n)
    rows = 2 * n if silu_mul else n
    weight, scale = torch.randint(-127, 128, (rows, 80), dtype=torch.int8), torch.rand(rows) * 0.01
    x, bias = torch.randn(2, 80).to(dtype), torch.randn(rows)
    assert_same_bits(at_threads(lambda: kernels.int8_linear(x, weight, scale, bias, silu_mul)))


@pytest.mark.parametrize("n", ROWS)
def test_small_linear_is_the_same_bits_at_any_thread_count(kernels, at_threads, n):
    if not kernels.small_linear_available():
        pytest.skip("this CPU has no AVX-512 BF16: small_linear is not built here")
    torch.manual_seed(n)
    weight, x = torch.randn(n, 64).bfloat16(), torch.randn(1, 64).bfloat16()
    assert_same_bits(at_threads(lambda: kernels.small_linear(x, weight, None, False)))


@pytest.mark.parametrize("n", ROWS)
def test_one_row_q8_0_block_linear_is_the_same_bits_at_any_thread_count(kernels, at_threads, n):
    if not kernels.block_linear_available():
        pytest.skip("this CPU has no AVX-512 VNNI: block_linear is not built here")
    torch.manual_seed(n)
    weight, scale = quantize_q8_0(torch.randn(n, 64))
    x = torch.randn(1, 64).bfloat16()
    assert_same_bits(at_threads(lambda: kernels.block_linear(x, weight, scale, None, 8, False)))


@pytest.mark.parametrize("batch, kv_heads", [(1, 1), (1, 2), (1, 8), (3, 5)])
def test_decode_attention_is_the_same_bits_at_any_thread_count(kernels, at_threads, batch, kv_heads):
    """(row, KV head) pairs are the items: one, as many as threads, more."""
    torch.manual_seed(batch * 10 + kv_heads)
    group, dim, block, blocks = 2, 32, 16, 4
    heads, slots = kv_heads * group, blocks * block * batch
    pool_k, pool_v = torch.randn(kv_heads, slots, dim), torch.randn(kv_heads, slots, dim)
    q = torch.randn(batch, heads, dim)
    tables = torch.arange(batch * blocks, dtype=torch.long).flip(0).view(batch, blocks)
    rows = torch.arange(batch, dtype=torch.long)
    lo = torch.zeros(batch, dtype=torch.long)
    hi = torch.tensor([blocks * block - 3 * b for b in range(batch)], dtype=torch.long)

    def attend():
        out = torch.zeros_like(q)
        return kernels.decode_attention(q, pool_k, pool_v, rows, tables, lo, hi, block, dim ** -0.5, out, True)
    assert_same_bits(at_threads(attend))
