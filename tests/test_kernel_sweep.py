"""Every compiled kernel over the shapes that break kernels: contexts around each power of two
up to 8,192 (and one past), block sizes 1, 16 and 64, odd head counts and group sizes, head
sizes with a vector tail, chunks that start inside a block, empty inputs; each against the
plain path's math (model.py's ``paged_attention``, a float64 product, model.py's parts).

The same tests are the body of the sanitizer run (``python -m tools.sanitize``), where the
kernels are built with AddressSanitizer, UBSan and bounds-checked vectors. A kernel this CPU's
instructions do not allow is checked to refuse ("built without ...") instead of running.
"""
from __future__ import annotations

import math

import pytest
import torch

from fast.attention import FastAttention, KernelDecode, KernelPrefill, KernelSharedDecode, Routes
from fast.kernels import compiled_kernels
from model import AttentionMetadata, SeqChunk, paged_attention, write_kv

# Around each power of two up to 8,192 (one past it too), past a model's own 2,048 / 4,096.
CONTEXTS = [n + d for n in (16, 256, 2048, 4096, 8192) for d in (-1, 0, 1)]
BLOCK_SIZES = [1, 16, 64]
# (query heads, KV heads, head size): group 3 twice (one KV head, two), no grouping with an odd
# head count, the tiles' limit of 16 per KV head; head sizes with and without a 16-lane tail.
HEADS = [(3, 1, 24), (6, 2, 80), (5, 5, 16), (16, 1, 8)]
CHUNK = 37  # a prompt chunk's length: divides no block size, starts inside a block
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    build = compiled_kernels()
    assert build.module is not None, build.reason  # g++ is on every machine this project uses
    return build.module


def routes(module) -> Routes:
    tiles = module.prefill_attention_available()
    return Routes(exact_decode_slots=False, matmul_attention=False, flash_lse=False,
                  decode_kernel=module.decode_attention,
                  prefill_kernel=module.prefill_attention if tiles else None,
                  shared_decode_kernel=module.shared_decode_attention if tiles else None)


def scattered_tables(lengths: list[int], block_size: int, shared: int = 0) -> tuple[list[list[int]], int]:
    """Block tables for contexts of ``lengths`` tokens, ids interleaved across sequences (as a
    pool in use hands them out), the first ``shared`` blocks common to all; and the pool's size."""
    need = [math.ceil(n / block_size) for n in lengths]
    tables, next_id = [[] for _ in lengths], shared
    for j in range(max(need)):
        for t, n in zip(tables, need):
            if j < shared:
                t.append(shared - 1 - j)  # reversed: a table is not an arange
            elif j < n:
                t.append(next_id)
                next_id += 1
    return tables, next_id + 1  # one spare block past the last id


def attention_case(chunks: list[SeqChunk], num_blocks: int, block_size: int, heads, dtype, seed: int):
    h, kvh, dim = heads
    g = torch.Generator().manual_seed(seed)
    tokens = sum(c.length for c in chunks)
    pool_k, pool_v = (torch.randn(kvh, num_blocks * block_size, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(tokens, h, dim, generator=g).to(dtype)
    k, v = (torch.randn(tokens, kvh, dim, generator=g).to(dtype) for _ in range(2))
    meta = AttentionMetadata.build(chunks, block_size, CPU)
    write_kv(pool_k, pool_v, meta.slot_mapping, k, v)
    return q, k, v, pool_k, pool_v, meta


def assert_kernels_match(chunks, num_blocks, block_size, heads, module, kinds, dtype=torch.float32, window=None):
    q, k, v, pool_k, pool_v, meta = attention_case(chunks, num_blocks, block_size, heads, dtype, seed=len(chunks))
    windows = {window}
    plan = FastAttention(windows, heads[0] // heads[1], dtype, CPU, routes(module)).plan(chunks, block_size)
    assert kinds <= {type(p) for p in plan.parts}, [type(p).__name__ for p in plan.parts]
    got = plan.attend(q, k, v, pool_k, pool_v, window)
    expected = paged_attention(q.double(), pool_k.double(), pool_v.double(), meta, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", HEADS, ids=lambda x: "h{}kv{}d{}".format(*x) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_decode_and_prompt_chunks_at_long_contexts(kernels, context, block_size, heads):
    """One step: a decode row after ``context`` tokens, a prompt chunk that ends there (after a
    prefix it continues), a one-token chunk and a short prompt from position 0; windowed too."""
    lengths = [context + 1, context, 1, 5]
    tables, num_blocks = scattered_tables(lengths, block_size)
    chunks = [SeqChunk(context, 1, tables[0]), SeqChunk(max(0, context - CHUNK), min(CHUNK, context), tables[1]),
              SeqChunk(0, 1, tables[2]), SeqChunk(0, 5, tables[3])]
    kinds = {KernelDecode} | ({KernelPrefill} if kernels.prefill_attention_available() else set())
    assert_kernels_match(chunks, num_blocks, block_size, heads, kernels, kinds)
    if context > 2 * CHUNK:  # a window that starts inside a block, far from the first key
        assert_kernels_match(chunks, num_blocks, block_size, heads, kernels, kinds, window=CHUNK + 3)


@pytest.mark.parametrize("heads", HEADS[:2], ids=lambda x: "h{}kv{}d{}".format(*x) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_decode_rows_sharing_a_long_prefix(kernels, context, block_size, heads):
    """Decode rows whose tables share every full block of ``context`` tokens (the shared-decode
    kernel where this CPU has it), each with its own tail of 1 to 17 tokens."""
    shared = context // block_size
    if shared == 0:
        shared, context = 1, block_size
    lengths = [shared * block_size + extra for extra in (1, 2, 17, 5, 9)]
    tables, num_blocks = scattered_tables(lengths, block_size, shared=shared)
    chunks = [SeqChunk(n - 1, 1, t) for n, t in zip(lengths, tables)]
    kinds = {KernelSharedDecode} if kernels.prefill_attention_available() else {KernelDecode}
    assert_kernels_match(chunks, num_blocks, block_size, heads, kernels, kinds)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_contexts_in_half_precision(kernels, dtype):
    context, block_size, heads = CONTEXTS[-1], 16, HEADS[1]
    lengths = [context + 1, context]
    tables, num_blocks = scattered_tables(lengths, block_size)
    chunks = [SeqChunk(context, 1, tables[0]), SeqChunk(context - CHUNK, CHUNK, tables[1])]
    kinds = {KernelDecode} | ({KernelPrefill} if kernels.prefill_attention_available() else set())
    assert_kernels_match(chunks, num_blocks, block_size, heads, kernels, kinds, dtype=dtype)


# ----------------------------------------------------------------------------- linears, norms, RoPE

def available(module, name: str) -> bool:
    probe = getattr(module, f"{name}_available", None)
    return probe is None or probe()


def reference_linear(x, weight, scale=None, bias=None, silu_mul=False):
    w = weight.double() * (scale.double()[:, None] if scale is not None else 1)
    y = x.double() @ w.T + (bias.double() if bias is not None else 0)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


LINEARS = {"small_linear": (4, torch.bfloat16, False), "int8_linear": (8, torch.bfloat16, True),
           "int8_tiles": (130, torch.bfloat16, True)}


@pytest.mark.parametrize("name", LINEARS)
@pytest.mark.parametrize("k", [1, 31, 33, 1000])
@pytest.mark.parametrize("n", [2, 34, 130])
def test_linears_at_every_row_count_and_odd_shapes(kernels, name, k, n):
    """Rows 0 (an empty step: once a crash, issue 45) to the kernel's most; inputs and weights
    whose sizes leave a vector tail; bias and the SiLU epilogue."""
    most, dtype, int8 = LINEARS[name]
    g = torch.Generator().manual_seed(k * n)
    if int8:
        weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / 64
    else:
        weight, scale = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype), None
    bias = torch.randn(n, generator=g).to(dtype)
    kernel = getattr(kernels, name)
    if not available(kernels, name):  # built without its instructions: it refuses, never runs
        with pytest.raises(RuntimeError, match="built without"):
            kernel(torch.randn(1, k).to(dtype), weight, *((scale,) if int8 else ()), bias, False)
        return
    rows = sorted({0, 1, 2, 3, 4, 5, 8, 17, most} & set(range(most + 1)))
    for m in rows:
        x = torch.randn(m, k, generator=g).to(dtype)
        for silu_mul in (False, True):
            args = (x, weight, scale, bias, silu_mul) if int8 else (x, weight, bias, silu_mul)
            got = kernel(*args)
            want = reference_linear(x, weight, scale, bias, silu_mul)
            assert got.shape == want.shape and got.dtype == dtype, (m, silu_mul)
            torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [0, 1, 17, 300])
@pytest.mark.parametrize("dim", [2, 18, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_rope_at_odd_shapes(kernels, tokens, dim, dtype):
    from model import RMSNorm
    g = torch.Generator().manual_seed(tokens + dim)
    heads, eps = 3, 1e-6
    x = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    weight = (1 + torch.randn(dim, generator=g) / 4).to(dtype)
    norm = RMSNorm(dim, eps).to(dtype)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(kernels.rms_norm(x, weight, eps), norm.compute(x))
    angles = torch.randn(tokens, dim // 2, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    normed = norm.compute(x).double()
    half = dim // 2
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat([normed[..., :half] * c - normed[..., half:] * s,
                      normed[..., half:] * c + normed[..., :half] * s], dim=-1)
    got = kernels.norm_rope(x, weight, eps, cos, sin)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), want, atol=3e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2)


# ----------------------------------------------------------------------------- refused at the boundary

def test_bad_operands_are_refused_not_read(kernels):
    """What a kernel relies on and cannot see in its loops is checked where Python calls it."""
    bf = torch.bfloat16
    x, w = torch.randn(2, 32).to(bf), torch.randn(8, 32).to(bf)
    bad = {
        "too many rows": lambda: kernels.small_linear(torch.randn(5, 32).to(bf), w, None, False),
        "bias of another size": lambda: kernels.small_linear(x, w, torch.randn(7).to(bf), False),
        "a scale per row": lambda: kernels.int8_linear(x, w.to(torch.int8), torch.rand(7), None, False),
        "norm weight of another size": lambda: kernels.rms_norm(x, torch.ones(31, dtype=bf), 1e-6),
        "odd RoPE width": lambda: kernels.norm_rope(torch.randn(2, 1, 5), None, 1e-6, torch.ones(2, 3), torch.ones(2, 3)),
    }
    pool = torch.randn(2, 64, 8)
    one = torch.zeros(1, dtype=torch.long)
    bad |= {
        "no KV heads": lambda: kernels.decode_attention(torch.randn(1, 2, 8), torch.randn(0, 64, 8),
                                                        torch.randn(0, 64, 8), one, torch.zeros(1, 4, dtype=torch.long),
                                                        one, one + 1, 16, 1.0, torch.randn(1, 2, 8)),
        "block size 0": lambda: kernels.decode_attention(torch.randn(1, 2, 8), pool, pool, one,
                                                         torch.zeros(1, 4, dtype=torch.long), one, one + 1, 0, 1.0,
                                                         torch.randn(1, 2, 8)),
        "a block id past the pool": lambda: kernels.decode_attention(
            torch.randn(1, 2, 8), pool, pool, one, torch.full((1, 4), 4, dtype=torch.long), one, one + 1, 16, 1.0,
            torch.randn(1, 2, 8)),
    }
    for what, call in bad.items():
        with pytest.raises(RuntimeError):
            call()
