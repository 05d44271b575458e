"""Each fast attention kind of fast/attention.py against model.py's plain paged attention.

The plain path (``model.paged_attention``: gather the blocks, one SDPA call) is the spec; the
first test checks it against attention written out slot by slot, mask by mask. The rest
build batches that hit every fast kind and edge: a prompt from position 0, a chunk after a
prefix, decode contexts spanning one and several chunks (and a partial last block), a decode
batch and prompt chunks sharing cached leading blocks, sliding windows, grouped-query heads,
the packed order of tokens mixing all of them, and the plain-math path used off CPU. Each
route a kind can take is chosen by the ``Routes`` the backend is built with, so every route
runs here on every machine. The HF-parity tests check whole models end to end.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

from fast import attention
from fast.attention import (DECODE_CHUNK_TOKENS, CausalPrefill, DecodeChunks, DecodeSlots,
                            FastAttention, KernelDecode, KernelPrefill, KernelSharedDecode,
                            PagedDecode, PagedPrefill, Routes, SharedPrefixDecode, SharedPrefixPrefill)
from engine import SamplingParams
from model import AttentionMetadata, SeqChunk, paged_attention, write_kv

BLOCK, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 4, 2, 4, 8, 200
CPU = torch.device("cpu")


def dense_reference(q, pool_k, pool_v, chunk: SeqChunk, window: int | None) -> torch.Tensor:
    """Attention of the chunk's queries over its context read slot by slot, mask by mask."""
    positions = torch.arange(chunk.start + chunk.length)
    slots = torch.tensor(chunk.block_table)[positions // BLOCK] * BLOCK + positions % BLOCK
    k = pool_k[:, slots].repeat_interleave(HEADS // KV_HEADS, dim=0)  # [H, ctx, D]
    v = pool_v[:, slots].repeat_interleave(HEADS // KV_HEADS, dim=0)
    q_pos = torch.arange(chunk.start, chunk.start + chunk.length)[:, None]
    allowed = positions[None, :] <= q_pos
    if window is not None:
        allowed &= positions[None, :] > q_pos - window
    scores = torch.einsum("thd,hkd->htk", q, k) / math.sqrt(DIM)
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    return torch.einsum("htk,hkd->thd", probs, v)


def random_step(chunks: list[SeqChunk], seed: int, head_dim: int = DIM, dtype: torch.dtype = torch.float32):
    """A random pool with this step's random K/V written into it, the step's queries and metadata."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(c.length for c in chunks)
    pool_k = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, head_dim, generator=g, dtype=dtype)
    pool_v = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, head_dim, generator=g, dtype=dtype)
    q = torch.randn(num_tokens, HEADS, head_dim, generator=g, dtype=dtype)
    k = torch.randn(num_tokens, KV_HEADS, head_dim, generator=g, dtype=dtype)
    v = torch.randn(num_tokens, KV_HEADS, head_dim, generator=g, dtype=dtype)
    meta = AttentionMetadata.build(chunks, BLOCK, torch.device("cpu"))
    write_kv(pool_k, pool_v, meta.slot_mapping, k, v)
    return q, k, v, pool_k, pool_v, meta


def run_batch(chunks: list[SeqChunk], windows: set, seed: int = 0, routes: Routes | None = None):
    """The fast kinds' plan for the step (``routes`` None: the PyTorch kinds as probed on this
    machine, no compiled kernel), checked equal to the plain path for every window."""
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed)
    routes = routes or Routes.probe(CPU, torch.float32)
    plan = FastAttention(windows, HEADS // KV_HEADS, torch.float32, CPU, routes).plan(chunks, BLOCK)
    torch.testing.assert_close(plan.positions, meta.positions, rtol=0, atol=0)
    torch.testing.assert_close(plan.slot_mapping, meta.slot_mapping, rtol=0, atol=0)
    for window in windows:
        expected = paged_attention(q, pool_k, pool_v, meta, window)
        got = plan.attend(q, k, v, pool_k, pool_v, window)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    return plan


def table(first_block: int, num_blocks: int) -> list[int]:
    """Scattered block ids, as a pool that has been in use hands them out."""
    return [(first_block + 7 * i) % NUM_BLOCKS for i in range(num_blocks)]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


LONG = 3 * DECODE_CHUNK_TOKENS + 5  # a decode context spanning four chunks


def mixed_batch() -> list[SeqChunk]:
    return [
        SeqChunk(10, 1, table(0, blocks_for(11))),          # decode, partial last block
        SeqChunk(0, 9, table(3, blocks_for(9))),            # a prompt from position 0
        SeqChunk(LONG, 1, table(40, blocks_for(LONG + 1))),  # decode over several chunks
        SeqChunk(8, 5, table(90, blocks_for(13))),          # a chunk after an 8-token prefix
        SeqChunk(6, 3, table(150, blocks_for(9))),          # ... and one after another prefix
        SeqChunk(0, 1, table(120, 1)),                      # a one-token prompt
    ]


@pytest.mark.parametrize("window", [None, 6])
def test_plain_path_is_attention_slot_by_slot(window):
    """The spec itself: every sequence's queries over its context, causal, windowed, GQA."""
    chunks = mixed_batch()
    q, _, _, pool_k, pool_v, meta = random_step(chunks, seed=8)
    out = paged_attention(q, pool_k, pool_v, meta, window)
    first = 0
    for c in chunks:
        expected = dense_reference(q[first:first + c.length], pool_k, pool_v, c, window)
        torch.testing.assert_close(out[first:first + c.length], expected, atol=1e-5, rtol=1e-5)
        first += c.length
    assert first == out.shape[0]


@pytest.mark.parametrize("windows", [{None}, {None, 6}, {6}])
def test_every_kind_in_one_packed_batch(windows):
    plan = run_batch(mixed_batch(), windows)
    kinds = {type(p) for p in plan.parts}
    assert kinds == {PagedDecode, CausalPrefill, PagedPrefill}


@pytest.mark.parametrize("windows", [{None}, {None, 6}])
def test_decode_batch_sharing_cached_blocks(windows):
    shared = table(5, 3)  # three full blocks every sequence holds
    chunks = [SeqChunk(n, 1, shared + table(60 + 13 * i, blocks_for(n + 1) - 3))
              for i, n in enumerate([12, 13, 20, LONG])]
    plan = run_batch(chunks, windows, seed=1)
    assert [type(p) for p in plan.parts] == [SharedPrefixDecode]
    assert plan.parts[0].batch == 4 and plan.parts[0].shared_blocks.tolist() == shared


@pytest.fixture(params=["slots", "chunks"])
def decode_keys(request):
    """Both ways decode reads its keys: exact slots by a sampled matmul (CPU float32) and
    equal-length chunks (everywhere else), each checked equal to the plain path."""
    exact = request.param == "slots"
    routes = Routes(exact_decode_slots=exact, matmul_attention=False, flash_lse=attention.CPU_FLASH_LSE)
    return routes, DecodeSlots if exact else DecodeChunks


@pytest.mark.parametrize("windows", [{None}, {None, 6}])
def test_decode_keys_both_ways(decode_keys, windows):
    """Decode rows alone, beside prompt chunks, and after shared blocks; contexts of one
    block, a partial last block, and several chunks; sliding windows."""
    routes, kind = decode_keys
    decode = [SeqChunk(n, 1, table(60 + 13 * i, blocks_for(n + 1)))
              for i, n in enumerate([0, 2, 12, 13, LONG])]
    plan = run_batch(decode, windows, seed=14, routes=routes)
    assert all(isinstance(keys, kind) for keys in plan.parts[0].chunks.values())
    run_batch(mixed_batch(), windows, seed=15, routes=routes)
    shared = table(5, 3)
    sharing = [SeqChunk(n, 1, shared + table(60 + 13 * i, blocks_for(n + 1) - 3))
               for i, n in enumerate([12, 13, 20, LONG])]
    plan = run_batch(sharing, windows, seed=16, routes=routes)
    assert isinstance(plan.parts[0].own, kind)


def test_exact_slots_where_the_sampled_matmul_runs():
    assert Routes.probe(CPU, torch.float32).exact_decode_slots
    assert not Routes.probe(CPU, torch.bfloat16).exact_decode_slots
    assert not Routes.probe(torch.device("cuda"), torch.float32).exact_decode_slots


def test_prefix_shared_only_up_to_the_shortest_context():
    """Blocks are shared only as far as every sequence's context reaches past them."""
    shared = table(5, 4)
    chunks = [SeqChunk(9, 1, shared[:3]), SeqChunk(30, 1, shared + table(70, 4))]
    plan = run_batch(chunks, {None}, seed=2)
    assert plan.parts[0].shared_blocks.tolist() == shared[:2]  # 9 // BLOCK full blocks


def test_single_decode_and_one_chunk_context():
    run_batch([SeqChunk(2, 1, table(9, 1))], {None, 6}, seed=3)


@pytest.mark.parametrize("windows", [{None}, {None, 6}])
def test_prefill_chunks_sharing_cached_blocks(windows):
    """Chunks after one cached prefix: the prefix attended once for all, merged by log-sum-exp."""
    shared = table(5, 3)
    chunks = [SeqChunk(n, length, shared + table(60 + 13 * i, blocks_for(n + length) - 3))
              for i, (n, length) in enumerate([(12, 5), (14, 7), (13, 2), (LONG, 9)])]
    plan = run_batch(chunks, windows, seed=4)
    assert [type(p) for p in plan.parts] == [SharedPrefixPrefill]
    assert plan.parts[0].shared_blocks.tolist() == shared
    assert (plan.parts[0].windowed is not None) == (6 in windows)


def test_one_long_prompt_continued_attends_its_earlier_chunks_unmasked():
    chunks = [SeqChunk(13, 9, table(9, blocks_for(22)))]
    plan = run_batch(chunks, {None}, seed=5)
    assert plan.parts[0].shared_blocks.tolist() == table(9, 3)  # 13 // BLOCK full blocks


def test_windowed_only_model_keeps_the_padded_prefill():
    shared = table(5, 3)
    chunks = [SeqChunk(12, 5, shared + table(60, 2)), SeqChunk(12, 3, shared + table(80, 1))]
    plan = run_batch(chunks, {6}, seed=6)
    assert [type(p) for p in plan.parts] == [PagedPrefill]


@pytest.mark.parametrize("windows", [{None}, {None, 6}])
def test_shared_kinds_with_plain_math(windows):
    """Off CPU (no flash kernel with log-sum-exp) the shared decode part uses matmuls and prefill
    chunks after a shared prefix take the padded SDPA; same results."""
    off_cpu = Routes.probe(torch.device("cuda"), torch.float32)
    assert not off_cpu.flash_lse
    shared = table(5, 3)
    decode = [SeqChunk(n, 1, shared + table(60 + 13 * i, blocks_for(n + 1) - 3))
              for i, n in enumerate([12, 20])]
    prefill = [SeqChunk(n, length, shared + table(120 + 11 * i, blocks_for(n + length) - 3))
               for i, (n, length) in enumerate([(12, 4), (15, 6)])]
    plan = run_batch(decode + prefill, windows, seed=7, routes=off_cpu)
    assert [type(p) for p in plan.parts] == [SharedPrefixDecode, PagedPrefill]


# ----------------------------------------------------------------------------- bfloat16 by matmuls
#
# On a CPU with native bfloat16 the kinds attend by tiled matmuls (attention.matmul_attention)
# instead of the flash kernel. Forced on here, so these run on every machine; the error
# against float32 must stay within a small factor of bfloat16 SDPA's own (scores rounded to
# bfloat16 once, as HF's eager attention does, roughly doubles it; a wrong mask or tile edge
# errs by the size of the values themselves).

BF16_ERROR_FACTOR = 3.0


def matmul_routes(tile_scores: int = 64) -> Routes:
    """Matmul attention on in bfloat16, with tiles small enough that every test crosses tiles."""
    return Routes(exact_decode_slots=False, matmul_attention=True, flash_lse=attention.CPU_FLASH_LSE,
                  tile_scores=tile_scores, min_tile_rows=2)


def mean_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return (got.float() - reference.float()).abs().mean().item()


@pytest.mark.parametrize("masked", [False, True])
def test_matmul_attention_against_float32(masked):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (37, 29, 29))
    mask = torch.where(torch.rand(2, 1, 37, 29, generator=g) < 0.3, -math.inf, 0.0) if masked else None
    if mask is not None:
        mask[..., 0] = 0.0  # every row sees a key
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-1, -2)) / 4.0 + (0.0 if mask is None else mask)
    bq, bk, bv = (x.bfloat16() for x in (q, k, v))
    bmask = None if mask is None else mask.bfloat16()
    sdpa = torch.nn.functional.scaled_dot_product_attention(bq, bk, bv, attn_mask=bmask)
    out, lse = attention.matmul_attention(bq, bk, bv, matmul_routes(), bmask, with_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert mean_error(out, expected) <= BF16_ERROR_FACTOR * mean_error(sdpa, expected)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=0.05, rtol=0.01)


def test_causal_matmul_attention_against_float32():
    routes = matmul_routes(tile_scores=2 * 3 * 41 * 7)  # tiles of 7 positions
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 3, 41, 16, generator=g)  # [KVH, g, L, D]
    k, v = torch.randn(2, 41, 16, generator=g), torch.randn(2, 41, 16, generator=g)
    expand = lambda x: x[:, None].expand(2, 3, 41, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, expand(k), expand(v), is_causal=True)
    bq, bk, bv = (x.bfloat16() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(bq, expand(bk), expand(bv), is_causal=True)
    got = attention.causal_matmul_attention(bq, bk, bv, routes)
    assert mean_error(got, expected) <= BF16_ERROR_FACTOR * mean_error(sdpa, expected)


@pytest.mark.parametrize("windows", [{None}, {None, 6}])
def test_every_kind_in_bfloat16_by_matmuls(windows):
    """Every kind (prompt from 0, decode, chunks after a prefix, shared prefixes) in bfloat16 by
    matmuls, against the plain path in float32 on the same inputs, and no worse than a small
    factor of the plain path's own bfloat16 error."""
    routes = matmul_routes(tile_scores=2 * 2 * 23 * 5)  # the 23-token prompt: tiles of 5
    shared = table(5, 3)
    chunks = mixed_batch() + [SeqChunk(12, 4, shared + table(120, 2)), SeqChunk(15, 6, shared + table(140, 3)),
                              SeqChunk(0, 23, table(170, blocks_for(23)))]
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed=9)
    bf = [x.bfloat16() for x in (q, k, v, pool_k, pool_v)]
    plan = FastAttention(windows, HEADS // KV_HEADS, torch.bfloat16, CPU, routes).plan(chunks, BLOCK)
    for window in windows:
        expected = paged_attention(q, pool_k, pool_v, meta, window)
        plain = paged_attention(bf[0], bf[3], bf[4], meta, window)
        got = plan.attend(*bf, window)
        assert got.dtype == torch.bfloat16
        assert mean_error(got, expected) <= BF16_ERROR_FACTOR * mean_error(plain, expected), window
        torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)


@pytest.fixture(scope="module")
def kernel_routes():
    """The routes with the compiled decode kernel (fast/kernels.py; built once per machine)."""
    from fast.kernels import compiled_kernels
    build = compiled_kernels()
    assert build.module is not None, build.reason  # g++ is on every machine this project uses
    return Routes(exact_decode_slots=False, matmul_attention=False, flash_lse=attention.CPU_FLASH_LSE,
                  decode_kernel=build.module.decode_attention)


@pytest.mark.parametrize("windows", [{None}, {None, 6}, {5}])
def test_kernel_decode_beside_prompt_chunks(kernel_routes, windows):
    """Decode rows by the compiled kernel, equal to the plain path: a batch beside prompt
    chunks, and a lone sequence with contexts of less than a block, one block and several
    chunks, windows that start inside a block."""
    plan = run_batch(mixed_batch(), windows, seed=12, routes=kernel_routes)
    assert {type(p) for p in plan.parts} == {KernelDecode, CausalPrefill, PagedPrefill}
    for context in (BLOCK - 1, BLOCK, LONG):
        chunks = [SeqChunk(0, 5, table(100, 2)), SeqChunk(context, 1, table(7, blocks_for(context + 1)))]
        plan = run_batch(chunks, windows, seed=context, routes=kernel_routes)
        assert {type(p) for p in plan.parts} == {CausalPrefill, KernelDecode}


@pytest.mark.parametrize("head_dim", [64, 72, 8])
@pytest.mark.parametrize("vector", [True, False])
def test_kernel_decode_batch_with_any_head_dim(kernel_routes, head_dim, vector):
    """A decode batch by the kernel: head_dim a multiple of the vector width, with a tail, and
    shorter than it; by its AVX-512 loops and by the plain loops other machines take."""
    routes = replace(kernel_routes, decode_kernel=functools.partial(kernel_routes.decode_kernel, vector=vector))
    chunks = [SeqChunk(n, 1, table(9 + 11 * i, blocks_for(n + 1))) for i, n in enumerate([0, 15, 16, 40, LONG])]
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed=3, head_dim=head_dim)
    plan = FastAttention({None, 6}, HEADS // KV_HEADS, torch.float32, CPU, routes).plan(chunks, BLOCK)
    assert [type(p) for p in plan.parts] == [KernelDecode]
    for window in (None, 6):
        torch.testing.assert_close(plan.attend(q, k, v, pool_k, pool_v, window),
                                   paged_attention(q, pool_k, pool_v, meta, window))


@pytest.fixture(scope="module")
def prefill_routes(kernel_routes):
    """The kernel routes with the compiled prompt-chunk and shared-decode attention as well."""
    from fast.kernels import compiled_kernels
    module = compiled_kernels().module
    if not module.prefill_attention_available():
        pytest.skip("this CPU has no AVX-512: the prompt-chunk kernel is not built here")
    return replace(kernel_routes, prefill_kernel=module.prefill_attention,
                   shared_decode_kernel=module.shared_decode_attention)


def shared_and_chunked() -> list[SeqChunk]:
    shared = table(5, 3)
    return [SeqChunk(12, 7, shared + table(60, 2)), SeqChunk(12, 4, shared + table(70, 1)),
            SeqChunk(0, 40, table(100, blocks_for(40))), SeqChunk(LONG, 30, table(20, blocks_for(LONG + 30)))]


@pytest.mark.parametrize("windows", [{None}, {None, 6}, {5}])
@pytest.mark.parametrize("chunks", [mixed_batch, shared_and_chunked])
def test_kernel_prefill_equals_the_plain_path(prefill_routes, windows, chunks):
    """Every prompt chunk by the compiled kernel: from position 0, after a cached prefix, after
    shared blocks, longer than a tile, one token long, windows starting inside a block."""
    plan = run_batch(chunks(), windows, seed=21, routes=prefill_routes)
    assert type(plan.parts[-1]) is KernelPrefill and all(type(p) is KernelDecode for p in plan.parts[:-1])


@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("heads", [HEADS, 2 * HEADS, KV_HEADS * 16])  # 2, 4 and 16 per KV head
def test_kernel_prefill_with_any_head_dim_and_group(prefill_routes, head_dim, heads):
    """Tiles of 16 query rows hold 8, 4 or 1 position(s) of 2, 4 or 16 query heads each."""
    chunks = shared_and_chunked()
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed=4, head_dim=head_dim)
    q = torch.randn(q.shape[0], heads, head_dim, generator=torch.Generator().manual_seed(5))
    plan = FastAttention({None, 6}, heads // KV_HEADS, torch.float32, CPU, prefill_routes).plan(chunks, BLOCK)
    for window in (None, 6):
        torch.testing.assert_close(plan.attend(q, k, v, pool_k, pool_v, window),
                                   paged_attention(q, pool_k, pool_v, meta, window))


@pytest.mark.parametrize("heads", [HEADS, KV_HEADS * 16])  # 2 or 16 query heads per KV head
@pytest.mark.parametrize("head_dim", [DIM, 72])
def test_kernel_shared_decode_equals_the_plain_path(prefill_routes, heads, head_dim):
    """Decode rows after the same leading blocks by the shared-decode kernel: more rows than a
    tile holds, own contexts from one token to several blocks; windowed layers by the decode
    kernel."""
    shared = table(5, 3)
    chunks = [SeqChunk(n, 1, shared + table(60 + 13 * i, blocks_for(n + 1) - 3))
              for i, n in enumerate([12, 13, 20, LONG, 12, 15, 30, 33, 50, 12])]
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed=8, head_dim=head_dim)
    q = torch.randn(len(chunks), heads, head_dim, generator=torch.Generator().manual_seed(9))
    plan = FastAttention({None, 6}, heads // KV_HEADS, torch.float32, CPU, prefill_routes).plan(chunks, BLOCK)
    assert [type(p) for p in plan.parts] == [KernelSharedDecode]
    for window in (None, 6):
        torch.testing.assert_close(plan.attend(q, k, v, pool_k, pool_v, window),
                                   paged_attention(q, pool_k, pool_v, meta, window))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_prefill_in_half_precision(prefill_routes, dtype):
    """In bfloat16 / float16, no worse than a small factor of the plain path's own error."""
    chunks = shared_and_chunked()
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed=13)
    low = [x.to(dtype) for x in (q, k, v, pool_k, pool_v)]
    plan = FastAttention({None, 6}, HEADS // KV_HEADS, dtype, CPU, prefill_routes).plan(chunks, BLOCK)
    for window in (None, 6):
        expected = paged_attention(q, pool_k, pool_v, meta, window)
        plain = paged_attention(low[0], low[3], low[4], meta, window)
        got = plan.attend(*low, window)
        assert got.dtype == dtype
        assert mean_error(got, expected) <= BF16_ERROR_FACTOR * mean_error(plain, expected), window


def test_kernel_leaves_shared_prefixes_to_the_shared_kind(kernel_routes):
    shared = table(5, 3)
    chunks = [SeqChunk(n, 1, shared + table(60 + 13 * i, blocks_for(n + 1) - 3))
              for i, n in enumerate([12, 13, 20, LONG])]
    plan = run_batch(chunks, {None}, seed=1, routes=kernel_routes)
    assert [type(p) for p in plan.parts] == [SharedPrefixDecode]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("windows", [{None}, {None, 6}])
def test_kernel_decode_in_half_precision(kernel_routes, dtype, windows):
    """The kernel in bfloat16 / float16 against the plain path in float32, and no worse than a
    small factor of the plain path's own error in that dtype."""
    chunks = [SeqChunk(LONG, 1, table(7, blocks_for(LONG + 1)))]
    q, k, v, pool_k, pool_v, meta = random_step(chunks, seed=11)
    low = [x.to(dtype) for x in (q, k, v, pool_k, pool_v)]
    plan = FastAttention(windows, HEADS // KV_HEADS, dtype, CPU, kernel_routes).plan(chunks, BLOCK)
    assert [type(p) for p in plan.parts] == [KernelDecode]
    for window in windows:
        expected = paged_attention(q, pool_k, pool_v, meta, window)
        plain = paged_attention(low[0], low[3], low[4], meta, window)
        got = plan.attend(*low, window)
        assert got.dtype == dtype
        assert mean_error(got, expected) <= BF16_ERROR_FACTOR * mean_error(plain, expected), window


def test_without_a_compiler_the_fast_layer_keeps_pytorch_and_says_why(monkeypatch, llama_dir):
    """No C++ compiler: no kernel, a reason naming the compiler, and an engine that runs on the
    PyTorch kinds and says so in its description."""
    from fast import kernels
    from helpers import make_llm
    monkeypatch.setenv("CXX", "no-such-compiler-step14")
    kernels.compiled_kernels.cache_clear()
    try:
        build = kernels.compiled_kernels()
        assert build.module is None and "no-such-compiler-step14" in build.reason
        llm = make_llm(llama_dir, enforce_eager=False)
        backend = llm.llm_engine.engine_core.model_runner.backend
        assert backend.attention.routes.decode_kernel is None
        assert "no C++ kernels (no C++ compiler 'no-such-compiler-step14' on PATH)" in backend.describe()
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
                   .outputs[0].token_ids) == 3
    finally:
        kernels.compiled_kernels.cache_clear()


def test_a_lone_sequence_decodes_by_the_kernel_with_hugging_faces_tokens(llama_dir, reference):
    """End to end: one request on an engine with the kernel (vLLM's default, enforce_eager
    False) decodes by KernelDecode at every decode step, and its greedy tokens are HF's."""
    from helpers import make_llm, random_prompt
    llm = make_llm(llama_dir, enforce_eager=False)
    backend = llm.llm_engine.engine_core.model_runner.backend
    assert backend.attention.routes.decode_kernel is not None, backend.describe()
    kinds = []
    plan = backend.plan
    backend.plan = lambda chunks, block_size: kinds.append(plan(chunks, block_size)) or kinds[-1]
    prompt = random_prompt(37, seed=5)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    reference.compare(prompt, out.outputs[0].token_ids, 12, "a lone sequence by the kernel")
    decode_steps = [p for p in kinds if len(p.positions) == 1]  # one token in the step: a decode
    assert len(decode_steps) == 11 and all(type(p.parts[0]) is KernelDecode for p in decode_steps)
