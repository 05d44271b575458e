"""Fast attention over the paged KV pool: the fast layer's attention backend.

model.py's ``paged_attention`` is the spec: gather each sequence's blocks, one SDPA call over
the padded batch. This file computes the same thing faster by sorting each step's tokens into
kinds of work, each with its own cheaper shape (``FastAttention.plan``): prompt chunks from
position 0 need no pool read, decode tokens read exactly their keys by a sampled matmul of the
pool (CPU float32) or batch into equal-length key chunks (elsewhere), and chunks or decode
steps after the same leading blocks attend those blocks once for all. Every kind is
tested equal to the plain path (tests/test_attention_kinds.py). Pure PyTorch: the same code
runs on CPU and CUDA; on CPU two kinds use the flash kernel's log-sum-exp to merge attention
over a shared prefix with the rest of each context. In bfloat16 on a CPU that computes it
natively, where that kernel is slow, the prompt kinds and the shared part attend by tiled
matmuls and a fused softmax instead (``matmul_attention``) -- where the compiled kernels are
off (they take every kind of row on CPU, one recipe for all: tests/test_cache_invariance.py). Which route each kind takes is a
``Routes`` value the backend is built with (fast/paths.py chooses it once per engine), never
a module global.

Reading order: routes -> the pool as the kinds read it -> attention kinds -> the planner.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fast.cpu_memory import empty_on_huge_pages
from fast.linear import native_low_precision
from model import SeqChunk, token_slots

CPU_FLASH_LSE = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


# ----------------------------------------------------------------------------- routes

@dataclass(frozen=True)
class Routes:
    """Which way each kind computes, for one device and dtype (``probe``, called by
    fast/paths.py's ``choose_paths`` only); tests pass their own.

    * ``exact_decode_slots``: decode reads exactly its keys by a sampled matmul of the pool
      (DecodeSlots) -- on CPU in float32, where a decode step runs 1.1-1.4x faster than with
      gathered chunks; CPU has no bfloat16 sampled matmul.
    * ``matmul_attention``: prompt kinds and shared parts attend by tiled matmuls and a fused
      softmax -- on a CPU with native bfloat16, where SDPA's flash kernel computes bfloat16
      several times below the matmul peak. In float32 the flash kernel is as fast, so it stays.
    * ``flash_lse``: the CPU flash kernel's log-sum-exp output is there (merging a shared prefix
      with the rest of each context needs it; without it the shared kinds are not used).
    * ``tile_scores`` / ``min_tile_rows``: rows of scores per tile of ``matmul_attention``:
      enough that both matmuls run near the peak, few enough that a tile stays in cache.
    * ``decode_kernel``: decode rows attend by the compiled kernel (fast/kernels.py), one call
      per layer instead of a dozen PyTorch ops.
    * ``prefill_kernel``: prompt chunks attend by the compiled kernel, straight from the pool,
      in every dtype: it computes each row by the decode kernel's recipe (fast/csrc/attention.cpp),
      so the prefix cache, chunking and batching never change a row's bits.
    * ``shared_decode_kernel``: decode rows that share leading blocks, by the compiled kernel
      that reads those blocks once per tile of rows.
    """

    exact_decode_slots: bool
    matmul_attention: bool
    flash_lse: bool
    tile_scores: int = 1 << 21
    min_tile_rows: int = 64
    decode_kernel: Callable | None = None  # fast/kernels.py's compiled decode attention
    prefill_kernel: Callable | None = None  # and its prompt-chunk attention
    shared_decode_kernel: Callable | None = None  # and its decode over shared leading blocks

    @classmethod
    def probe(cls, device: torch.device, dtype: torch.dtype) -> Routes:
        cpu = device.type == "cpu"
        return cls(
            exact_decode_slots=(cpu and dtype == torch.float32 and hasattr(torch.sparse, "sampled_addmm")
                                and hasattr(torch, "segment_reduce")),
            matmul_attention=cpu and dtype == torch.bfloat16 and native_low_precision(dtype),
            flash_lse=CPU_FLASH_LSE and cpu and dtype in (torch.float32, torch.bfloat16))


# ----------------------------------------------------------------------------- KV pool as layers read it

class Scratch:
    """Buffers reused by every layer and step. On CPU a fresh multi-MB tensor per pool read
    costs more in page faults than the copy into it; these sit on huge pages."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._offsets_key: tuple | None = None
        self._offsets: torch.Tensor | None = None

    def head_offsets(self, heads: int, blocks_per_head: int, device: torch.device) -> torch.Tensor:
        """[heads, 1]: the first row of each head's blocks in a pool viewed one row per block."""
        key = (heads, blocks_per_head, device)
        if self._offsets_key != key:
            self._offsets_key = key
            self._offsets = torch.arange(heads, device=device)[:, None] * blocks_per_head
        return self._offsets

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = empty_on_huge_pages((numel,), like.dtype, like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class LayerKV:
    """One layer's K and V pool read head-major, ``[num_kv_heads, num_blocks * block_size, head_dim]``:
    slot ``block_id * block_size + offset`` of each head. Gathered blocks then come out as
    per-head contiguous keys, ready for batched matmuls without a transposing copy."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    scratch: Scratch
    routes: Routes

    def read_blocks(self, block_ids: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_ids`` in order, as [KVH, len(block_ids) * block_size, D] each,
        copied into the scratch buffers called ``name`` (valid until the next read by that name)."""
        return self.read(self.k, block_ids, name + ".k"), self.read(self.v, block_ids, name + ".v")

    def read(self, pool: torch.Tensor, block_ids: torch.Tensor, name: str) -> torch.Tensor:
        heads, dim = pool.shape[0], pool.shape[2]
        # One row per (head, block): a gather along dim 0 runs on every thread, one along
        # dim 1 on one.
        rows = pool.view(-1, self.block_size * dim)
        ids = (self.scratch.head_offsets(heads, rows.shape[0] // heads, pool.device)
               + block_ids).view(-1)
        buf = self.scratch.get(name, (ids.numel(), rows.shape[1]), pool)
        return torch.index_select(rows, 0, ids, out=buf).view(heads, -1, dim)


# ----------------------------------------------------------------------------- attention kinds
#
# Each step's tokens fall into these kinds of attention, chosen by FastAttention.plan:
#   CausalPrefill       a prompt chunk from position 0: attends only to its own fresh K/V
#   KernelDecode        decode rows by the compiled kernel where there is one
#   KernelPrefill       prompt chunks by the compiled kernel (float32), in place of the next four
#   KernelSharedDecode  decode rows after the same leading blocks, by the compiled kernel
#   PagedDecode         single-token queries over their paged context: exact slots (DecodeSlots)
#                       on CPU float32, else equal-length chunks (DecodeChunks)
#   SharedPrefixDecode  the same, when every sequence holds the same leading blocks
#   PagedPrefill        prompt chunks after a cached or computed prefix: padded SDPA over the pool
#   SharedPrefixPrefill the same, when all of them start after the same leading blocks: those
#                       blocks once, unmasked, for every chunk; the rest as PagedPrefill; merged
#                       exactly by log-sum-exp
# Each kind writes its tokens' rows of ``out``. Queries are [tokens, heads, D]; grouped-query
# attention pairs query head h with KV head h // (heads // KVH), as HF's repeat_kv does.

# Keys per decode chunk: few enough that padding each sequence's last chunk costs little,
# enough that the batched matmuls are not all overhead (chosen by timing 16 to 256).
DECODE_CHUNK_TOKENS = 64


@dataclass
class CausalPrefill:
    """A prompt chunk from position 0: no pool read, and full-attention layers use the causal
    kernel (no mask, the upper half of the scores skipped)."""

    tokens: slice
    window_masks: dict  # sliding window -> additive [L, L] mask over the chunk's own tokens

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        if window is None and cache.routes.matmul_attention:
            return self.attend_by_matmuls(q, k, v, out, cache.routes)
        qs, ks, vs = (x[self.tokens].transpose(0, 1)[None] for x in (q, k, v))
        gqa = ks.shape[1] != qs.shape[1]
        if window is None:
            res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            res = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self.window_masks[window],
                                                 enable_gqa=gqa)
        out[self.tokens] = res[0].transpose(0, 1)

    def attend_by_matmuls(self, q, k, v, out: torch.Tensor, routes: Routes) -> None:
        own = q[self.tokens]
        length, heads, dim = own.shape
        qs = own.view(length, k.shape[1], -1, dim).permute(1, 2, 0, 3)  # [KVH, g, L, D]
        ks, vs = (x[self.tokens].transpose(0, 1).contiguous() for x in (k, v))
        res = causal_matmul_attention(qs, ks, vs, routes)
        out[self.tokens] = res.permute(2, 0, 1, 3).reshape(length, heads, dim)


@dataclass
class DecodeChunks:
    """The keys single-token queries read, cut into chunks of equal length: chunk i holds
    blocks of sequence ``owner[i]``; a sequence's last chunk is padded by repeating its last
    block, masked out. Equal chunks batch into one matmul whatever the context lengths, and
    only one chunk per sequence is padded (not every sequence to the longest)."""

    owner: torch.Tensor        # [N] decode row of each chunk
    block_ids: torch.Tensor    # [N * blocks per chunk]
    mask: torch.Tensor         # [N, 1, chunk length] additive: 0 = visible, -inf = not
    value_slots: torch.Tensor  # [N * g * chunk length] pool slot of every key, once per query row
    num_seqs: int
    _value_rows: dict = field(default_factory=dict, repr=False)

    def value_rows(self, heads: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """value_slots for every KV head of a pool viewed as [heads * slots, D], and where each
        bag (head, chunk, query row) starts: one embedding_bag per layer, built once per step."""
        if (heads, slots) not in self._value_rows:
            base = torch.arange(heads, device=self.value_slots.device)[:, None] * slots
            rows = (base + self.value_slots).view(-1)
            starts = torch.arange(0, rows.numel(), self.mask.shape[-1], device=rows.device)
            self._value_rows[heads, slots] = rows, starts
        return self._value_rows[heads, slots]

    def partials(self, q: torch.Tensor, cache: LayerKV) -> tuple[tuple, torch.Tensor]:
        """(out, peak, total) of every chunk, and the decode row each belongs to."""
        return chunk_partials(q, cache, self), self.owner

    def attend(self, q: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        """Normalised attention per decode row, [KVH, B, g, D]: the chunks merged."""
        return merge_partials([chunk_partials(q, cache, self)], [self.owner], self.num_seqs)


def chunk_partials(q: torch.Tensor, cache: LayerKV, chunks: DecodeChunks):
    """q: [B, KVH, g, D], already scaled. Unnormalised attention of every chunk on its own.

    Keys are gathered (a matmul needs them contiguous); values are not: embedding_bag sums
    the probability-weighted value rows straight from the pool, one bag per (KV head, chunk,
    query row), all heads in one call."""
    k = cache.read(cache.k, chunks.block_ids, "decode.k")
    heads, num_chunks, dim = k.shape[0], chunks.owner.numel(), k.shape[2]
    rows = q.index_select(0, chunks.owner).transpose(0, 1)  # [KVH, N, g, D]
    scores = torch.matmul(rows, k.view(heads, num_chunks, -1, dim).transpose(2, 3)).float()
    peak = scores.add_(chunks.mask).amax(-1, keepdim=True)
    probs = scores.sub_(peak).exp_()
    value_rows, bag_starts = chunks.value_rows(heads, cache.v.shape[1])
    out = F.embedding_bag(value_rows, cache.v.view(-1, dim), bag_starts, mode="sum",
                          per_sample_weights=probs.to(cache.v.dtype).view(-1))
    return out.view(heads, num_chunks, -1, dim).float(), peak, probs.sum(-1, keepdim=True)


def merge_partials(parts: list, owners: list[torch.Tensor], num_seqs: int) -> torch.Tensor:
    """Exact attention from partials over disjoint key sets (dim 1 indexes partials, ``owners``
    says whose): rescale each by exp(its max - the row's max), sum, divide. [KVH, B, g, D]."""
    out, peak, total = (torch.cat(x, dim=1) if len(x) > 1 else x[0] for x in zip(*parts))
    owner = torch.cat(owners) if len(owners) > 1 else owners[0]
    heads, _, group, dim = out.shape
    row_peak = peak.new_full((heads, num_seqs, group, 1), -math.inf)
    row_peak.scatter_reduce_(1, owner.view(1, -1, 1, 1).expand_as(peak), peak, "amax")
    scale = (peak - row_peak.index_select(1, owner)).exp_()
    num = out.new_zeros(heads, num_seqs, group, dim).index_add_(1, owner, out.mul_(scale))
    den = total.new_zeros(heads, num_seqs, group, 1).index_add_(1, owner, total.mul_(scale))
    return num.div_(den)


@dataclass
class DecodeSlots:
    """The keys single-token queries read, exactly: row r (query head r % g of the group of
    decode row r // g) holds the pool slots of its visible keys, no padding and no mask.
    Scores come from one sampled matmul straight off the pool (no gathered copy of the keys),
    values from one embedding_bag, each sequence normalised on its own (nothing to merge)."""

    slots: torch.Tensor   # [nnz] pool slot of every visible key, row after row
    starts: torch.Tensor  # [R + 1] where each row's keys start in ``slots`` (CSR row pointers)
    num_seqs: int
    _layout: tuple | None = field(default=None, repr=False)

    def layout(self, heads: int, num_slots: int, dtype: torch.dtype) -> SlotLayout:
        """The same rows for every KV head of a pool with ``num_slots`` slots; built once a step."""
        if self._layout is None or self._layout[0] != (heads, num_slots, dtype):
            self._layout = (heads, num_slots, dtype), SlotLayout.build(self, heads, num_slots, dtype)
        return self._layout[1]

    def partials(self, q: torch.Tensor, cache: LayerKV) -> tuple[tuple, torch.Tensor]:
        """(out, peak, total), one partial per decode row, and the rows they belong to."""
        return slot_partials(q, cache, self), torch.arange(self.num_seqs, device=q.device)

    def attend(self, q: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        """Normalised attention per decode row, [KVH, B, g, D]: nothing to merge."""
        out, _, total = slot_partials(q, cache, self)
        return out.div_(total)


@dataclass
class SlotLayout:
    """DecodeSlots as the layer's ops take them, for every KV head."""

    pattern: torch.Tensor      # batched CSR [heads, R, num_slots]: the sampled matmul's pattern
    row_of: torch.Tensor       # [heads, nnz]
    row_lengths: torch.Tensor  # [heads, R]
    bag_rows: torch.Tensor     # [heads * nnz] rows of the value pool viewed [heads * num_slots, D]
    bag_starts: torch.Tensor   # [heads * R] where each (head, row) bag starts

    @classmethod
    def build(cls, slots: DecodeSlots, heads: int, num_slots: int, dtype: torch.dtype) -> SlotLayout:
        nnz, device = slots.slots.numel(), slots.slots.device
        per_head = torch.arange(heads, device=device)[:, None]
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            pattern = torch.sparse_csr_tensor(
                slots.starts.expand(heads, -1).contiguous(), slots.slots.expand(heads, -1).contiguous(),
                torch.zeros(heads, nnz, dtype=dtype, device=device),
                size=(heads, slots.starts.numel() - 1, num_slots), check_invariants=False)
        lengths = slots.starts[1:] - slots.starts[:-1]
        row_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        return cls(pattern, row_of.expand(heads, -1), lengths.expand(heads, -1).contiguous(),
                   (per_head * num_slots + slots.slots).view(-1),
                   (per_head * nnz + slots.starts[:-1]).view(-1))


def slot_partials(q: torch.Tensor, cache: LayerKV, slots: DecodeSlots):
    """q: [B, KVH, g, D], already scaled. The same (out, peak, total) as chunk_partials, one
    partial per sequence: scores by ``torch.sparse.sampled_addmm`` of the pool itself."""
    batch, heads, group, dim = q.shape
    rows = q.transpose(0, 1).reshape(heads, batch * group, dim)
    at = slots.layout(heads, cache.k.shape[1], q.dtype)
    scores = torch.sparse.sampled_addmm(at.pattern, rows, cache.k.transpose(1, 2),
                                        beta=0.0).values()  # [KVH, nnz]
    peak = scores.new_full((heads, batch * group), -math.inf).scatter_reduce_(1, at.row_of, scores,
                                                                              "amax")
    weights = scores.sub_(peak.gather(1, at.row_of)).exp_()
    # segment_reduce sums 4x faster than index_add_, but scatter_reduce_ takes the max 4x
    # faster than segment_reduce (measured on [4, 20480]).
    total = torch.segment_reduce(weights, "sum", lengths=at.row_lengths, axis=1)
    out = F.embedding_bag(at.bag_rows, cache.v.view(-1, dim), at.bag_starts, mode="sum",
                          per_sample_weights=weights.view(-1))
    shape = (heads, batch, group, 1)
    return out.view(heads, batch, group, dim), peak.view(shape), total.view(shape)


def matmul_attention(q, k, v, routes: Routes, mask: torch.Tensor | None = None,
                     scale: float | None = None, with_lse: bool = False):
    """Softmax attention by two matmuls per tile of query rows. q [..., R, D], k/v [..., Lk, D]
    (same leading dims), ``mask`` additive and broadcastable to [..., R, Lk]. Scores are in
    q's dtype and the softmax accumulates in float32, as HF's eager attention does. Returns
    out [..., R, D], and with ``with_lse`` also each row's float32 log-sum-exp [..., R]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q if scale == 1.0 else q * scale  # the shared decode part passes queries scaled already
    keys_t = k.transpose(-1, -2)
    rows, num_keys = q.shape[-2], k.shape[-2]
    tile = max(routes.min_tile_rows, routes.tile_scores // max(1, q[..., 0, 0].numel() * num_keys))
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if with_lse else None
    for r0 in range(0, rows, tile):
        scores = torch.matmul(q[..., r0:r0 + tile, :], keys_t)
        if mask is not None:
            scores.add_(mask[..., r0:r0 + tile, :] if mask.shape[-2] > 1 else mask)
        if with_lse:
            out[..., r0:r0 + tile, :], lse[..., r0:r0 + tile] = _attend_with_lse(scores, v)
        else:
            out[..., r0:r0 + tile, :] = torch.matmul(torch.softmax(scores, dim=-1), v)
    return (out, lse) if with_lse else out


def _attend_with_lse(scores: torch.Tensor, v: torch.Tensor):
    """One float32 pass for both results: exp(scores - row max) weights the values, their
    sum normalises them and gives the log-sum-exp."""
    scores = scores.float()
    peak = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights.to(v.dtype), v).float().div_(total)
    return out, peak.add_(total.log_()).squeeze(-1)


def causal_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            routes: Routes) -> torch.Tensor:
    """Causal matmul_attention of one prompt from position 0, tiles of query positions reading
    only the keys up to the tile's last position. q [KVH, g, L, D], k/v [KVH, L, D] ->
    [KVH, g, L, D]."""
    heads, group, length, dim = q.shape
    q = q * dim ** -0.5
    tile = max(1, routes.min_tile_rows // group, routes.tile_scores // (heads * group * length))
    out = torch.empty_like(q)
    for p0 in range(0, length, tile):
        p1 = min(length, p0 + tile)
        rows = q[:, :, p0:p1].reshape(heads, group * (p1 - p0), dim)
        scores = torch.matmul(rows, k[:, :p1].transpose(1, 2)).view(heads, group, p1 - p0, p1)
        future = torch.ones(p1 - p0, p1 - p0, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., p0:].masked_fill_(future, -math.inf)
        probs = torch.softmax(scores, dim=-1).view(heads, -1, p1)
        out[:, :, p0:p1] = torch.matmul(probs, v[:, :p1]).view(heads, group, p1 - p0, dim)
    return out


def masked_attention(q, k, v, mask: torch.Tensor, routes: Routes) -> torch.Tensor:
    """SDPA with an additive mask, by the faster route for q's dtype and device."""
    if routes.matmul_attention:
        return matmul_attention(q, k, v, routes, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_with_lse(q, k, v, routes: Routes, mask: torch.Tensor | None = None,
                       scale: float | None = None):
    """Softmax attention and each query row's log-sum-exp of scores, so that attention over
    disjoint key sets can be merged exactly. q [B, H, Lq, D], k/v [B, H, Lk, D] (same H),
    ``mask`` additive and broadcastable to [B, H, Lq, Lk]. Returns (out, float32 lse [B, H, Lq]).

    On CPU this is matmul_attention in bfloat16 where that is faster, else the flash kernel
    SDPA itself runs (its log-sum-exp output is not exposed by the public API); elsewhere
    plain math."""
    if routes.matmul_attention:
        return matmul_attention(q, k, v, routes, mask, scale, with_lse=True)
    if routes.flash_lse:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul((scores - lse[..., None]).exp().to(v.dtype), v), lse


def merge_two(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Exact attention over the union of two disjoint key sets from each set's normalised
    result and log-sum-exp: weight each by exp(lse - the larger lse). float32 [..., D]."""
    peak = torch.maximum(lse_a, lse_b)
    w_a = (lse_a - peak).exp_().unsqueeze(-1)
    w_b = (lse_b - peak).exp_().unsqueeze(-1)
    return (out_a.float() * w_a).add_(out_b.float() * w_b).div_(w_a.add_(w_b))


def decode_queries(q: torch.Tensor, rows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The decode rows of q as [B, KVH, g, D], scaled by 1/sqrt(D) as SDPA would."""
    q = q.index_select(0, rows)
    return q.view(q.shape[0], num_kv_heads, -1, q.shape[2]) * q.shape[2] ** -0.5


def write_decode(out: torch.Tensor, rows: torch.Tensor, res: torch.Tensor) -> None:
    """[KVH, B, g, D] attention results back to the packed rows of out ([tokens, heads, D])."""
    out[rows] = res.transpose(0, 1).reshape(rows.numel(), -1, res.shape[3]).to(out.dtype)


@dataclass
class PagedDecode:
    """Single-token queries (decode steps) over each sequence's paged context."""

    rows: torch.Tensor  # packed-token index of each sequence's query
    chunks: dict        # window (None = full attention) -> the visible keys (DecodeChunks | DecodeSlots)

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        qd = decode_queries(q, self.rows, cache.k.shape[0])
        write_decode(out, self.rows, self.chunks[window].attend(qd, cache))


@dataclass
class KernelDecode:
    """Decode rows attended by the compiled kernel: each row's keys and values read straight
    from its blocks (``tables``), positions [lo, hi) visible (per window), float32 softmax;
    one call per layer for the whole batch."""

    rows: torch.Tensor    # [B] packed-token index of each row's query
    tables: torch.Tensor  # [B, blocks] block tables
    lo: dict              # window (None = full) -> [B] first visible position
    hi: torch.Tensor      # [B] context lengths (each query's position + 1)
    kernel: Callable

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        self.kernel(q, cache.k, cache.v, self.rows, self.tables, self.lo[window], self.hi,
                    cache.block_size, q.shape[-1] ** -0.5, out)


@dataclass
class KernelPrefill:
    """Every prompt chunk of the step attended by the compiled kernel: causal within each
    chunk, over its cached or computed prefix too, keys and values read from the blocks."""

    first_token: torch.Tensor  # [C] each chunk's first row in the packed batch
    starts: torch.Tensor       # [C] its first position
    lengths: torch.Tensor      # [C]
    tables: torch.Tensor       # [C, blocks]
    kernel: Callable

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        self.kernel(q, cache.k, cache.v, self.first_token, self.starts, self.lengths, self.tables,
                    cache.block_size, q.shape[-1] ** -0.5, window or 0, out)


@dataclass
class KernelSharedDecode:
    """Decode rows that all hold the same leading blocks, by the compiled kernel: the shared
    keys read once per tile of rows, each row's own keys after them; a sliding-window layer
    sees a different part of the prefix per row and takes the decode kernel."""

    rows: torch.Tensor
    tables: torch.Tensor
    hi: torch.Tensor
    shared_blocks: int
    windowed: KernelDecode  # its lo per window
    kernel: Callable

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        if window is not None:
            return self.windowed.attend(q, k, v, cache, window, out)
        self.kernel(q, cache.k, cache.v, self.rows, self.tables, self.hi, self.shared_blocks,
                    cache.block_size, q.shape[-1] ** -0.5, out)


@dataclass
class SharedPrefixDecode:
    """Decode steps of sequences that all hold the same leading blocks (a cached system
    prompt): the shared blocks are read once and scored for the whole batch in one matmul
    per KV head, instead of once per sequence."""

    rows: torch.Tensor
    batch: int
    shared_blocks: torch.Tensor  # the leading block ids every sequence holds
    own: DecodeChunks | DecodeSlots  # each sequence's keys after the shared blocks
    windowed: dict               # sliding window -> DecodeChunks or DecodeSlots of the visible keys

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        qd = decode_queries(q, self.rows, cache.k.shape[0])
        write_decode(out, self.rows, shared_prefix_decode(qd, cache, window, self))


def shared_prefix_decode(q, cache: LayerKV, window: int | None, part: SharedPrefixDecode):
    """Attention of a SharedPrefixDecode batch: the shared keys as one partial, each sequence's
    own chunks as others, one merge (exact softmax). A sliding window sees a different part of
    the prefix per sequence, so windowed layers take the plain chunked path."""
    if window is not None:
        return part.windowed[window].attend(q, cache)
    ks, vs = cache.read_blocks(part.shared_blocks, "shared")
    heads, group, dim = q.shape[1], q.shape[2], q.shape[3]
    rows = q.transpose(0, 1).reshape(1, heads, part.batch * group, dim)
    out, lse = attention_with_lse(rows, ks[None], vs[None], cache.routes, scale=1.0)  # q is scaled
    # A normalised partial is (out, peak=lse, total=1) in merge_partials' terms.
    shared = (out.view(heads, part.batch, group, dim).float(),
              lse.view(heads, part.batch, group, 1), lse.new_ones(heads, part.batch, group, 1))
    everyone = torch.arange(part.batch, device=q.device)
    own, owner = part.own.partials(q, cache)
    return merge_partials([shared, own], [everyone, owner], part.batch)


@dataclass
class PagedPrefill:
    """Prompt chunks that continue a cached or earlier-computed prefix: each reads its context
    (or, in a SharedPrefixPrefill, the part after the shared blocks) from the pool; queries are
    padded to the longest chunk (padding repeats the last token and is dropped), one SDPA call
    with a mask per window."""

    query_index: torch.Tensor  # [B * Lq] packed token of each padded query slot
    block_ids: torch.Tensor    # [B * context blocks]
    masks: dict                # window -> additive [B, 1, Lq * g, context blocks * block_size]
    real: torch.Tensor         # which of the B * Lq slots are real queries...
    real_tokens: torch.Tensor  # ...and their packed-token index
    batch: int
    q_len: int

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        kc, vc = self.keys(cache)
        self.scatter(out, masked_attention(self.queries(q, cache), kc, vc, self.masks[window],
                                           cache.routes))

    def queries(self, q: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        """The padded queries grouped by KV head, [B, KVH, Lq * g, D]."""
        kv_heads, dim = cache.k.shape[0], q.shape[2]
        return (q.index_select(0, self.query_index).view(self.batch, self.q_len, kv_heads, -1, dim)
                .transpose(1, 2).reshape(self.batch, kv_heads, -1, dim))

    def keys(self, cache: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        kv_heads, dim = cache.k.shape[0], cache.k.shape[2]
        return tuple(x.view(kv_heads, self.batch, -1, dim).transpose(0, 1)
                     for x in cache.read_blocks(self.block_ids, "prefill"))

    def scatter(self, out: torch.Tensor, res: torch.Tensor) -> None:
        """[B, KVH, Lq * g, D] results back to the real tokens' rows of out."""
        dim = res.shape[3]
        res = (res.view(self.batch, res.shape[1], self.q_len, -1, dim).transpose(1, 2)
               .reshape(self.batch * self.q_len, -1, dim))
        out[self.real_tokens] = res.index_select(0, self.real).to(out.dtype)


@dataclass
class SharedPrefixPrefill:
    """Prompt chunks that all continue after the same leading blocks (a cached system prompt,
    or one long prompt's earlier chunks): every query sees all of those keys, so they are
    attended without a mask in one call for all chunks, the rest of each context as a
    PagedPrefill, and the two merged exactly by log-sum-exp. A sliding window sees a
    different part of the prefix per query: windowed layers take the plain PagedPrefill."""

    shared_blocks: torch.Tensor
    own: PagedPrefill          # each chunk's keys after the shared blocks (full attention)
    windowed: PagedPrefill | None

    def attend(self, q, k, v, cache: LayerKV, window: int | None, out: torch.Tensor) -> None:
        if window is not None:
            return self.windowed.attend(q, k, v, cache, window, out)
        own = self.own
        qs = own.queries(q, cache)
        kc, vc = own.keys(cache)
        own_out, own_lse = attention_with_lse(qs, kc, vc, cache.routes, mask=own.masks[None])
        batch, kv_heads, rows, dim = qs.shape
        ks, vs = cache.read_blocks(self.shared_blocks, "shared")
        everyone = qs.transpose(0, 1).reshape(1, kv_heads, batch * rows, dim)
        shared_out, shared_lse = attention_with_lse(everyone, ks[None], vs[None], cache.routes)
        shared_out = shared_out.view(kv_heads, batch, rows, dim).transpose(0, 1)
        shared_lse = shared_lse.view(kv_heads, batch, rows).transpose(0, 1)
        own.scatter(out, merge_two(own_out, own_lse, shared_out, shared_lse))


# ----------------------------------------------------------------------------- the planner

class FastAttention:
    """The attention backend (model.py's protocol) for one model: its sliding windows, query
    heads per KV head, dtype, device and ``routes``; the plans share one set of scratch buffers."""

    def __init__(self, windows: set, queries_per_kv: int, dtype: torch.dtype,
                 device: torch.device, routes: Routes) -> None:
        self.windows, self.queries_per_kv = windows, queries_per_kv
        self.dtype, self.device = dtype, device
        self.routes = routes
        self.scratch = Scratch()

    def plan(self, chunks: list[SeqChunk], block_size: int) -> FastPlan:
        positions, slots, _ = token_slots(chunks, block_size)
        batch = PackedBatch.build(chunks, block_size, self.windows, self.queries_per_kv,
                                  self.dtype, self.device, self.routes)
        return FastPlan(batch.tensor(positions), batch.tensor(slots), _attention_parts(batch),
                        block_size, self.scratch, self.routes)


@dataclass
class FastPlan:
    """One step's attention kinds; every layer runs them on its own pool."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    parts: list  # CausalPrefill | PagedDecode | SharedPrefixDecode | PagedPrefill | SharedPrefixPrefill
    block_size: int
    scratch: Scratch
    routes: Routes

    @property
    def kernel_decode(self) -> KernelDecode | None:
        """The step's one attention kind where it is the decode kernel's (every row decoding)."""
        parts = self.parts
        return parts[0] if len(parts) == 1 and type(parts[0]) is KernelDecode else None

    def attend(self, q, k, v, pool_k, pool_v, window: int | None) -> torch.Tensor:
        """q: [T, H, D]; k, v: this step's [T, KVH, D], already written into the pool
        (pool_k, pool_v: one layer's [KVH, slots, D]). Same result as model.paged_attention."""
        cache = LayerKV(pool_k, pool_v, self.block_size, self.scratch, self.routes)
        out = torch.empty_like(q)
        for part in self.parts:
            part.attend(q, k, v, cache, window, out)
        return out


@dataclass
class PackedBatch:
    """One step's chunks as numpy arrays, and what every kind's builder needs besides."""

    lengths: np.ndarray
    starts: np.ndarray
    first_token: np.ndarray  # index of each chunk's first token in the packed batch
    tables: np.ndarray       # block tables, zero-padded to the longest
    block_size: int
    windows: set             # sliding windows of the model's layers (None = full attention)
    queries_per_kv: int
    dtype: torch.dtype
    device: torch.device
    routes: Routes

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, windows: set, queries_per_kv: int,
              dtype: torch.dtype, device: torch.device, routes: Routes) -> PackedBatch:
        lengths = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        tables = _pad_block_tables([c.block_table for c in chunks])
        return cls(lengths, starts, np.cumsum(lengths) - lengths, tables, block_size, windows,
                   queries_per_kv, dtype, device, routes)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def additive(self, allowed: np.ndarray) -> torch.Tensor:
        """0 where attention is allowed, -inf elsewhere, in the model's dtype."""
        return self.tensor(np.where(allowed, 0.0, -np.inf)).to(self.dtype)


def _attention_parts(batch: PackedBatch) -> list:
    """Decode tokens batch well; a prompt chunk from position 0 gets its own causal call (no
    padding, half the scores skipped); chunks after a cached or computed prefix share one."""
    lengths, starts = batch.lengths, batch.starts
    parts = []
    decode = np.flatnonzero(lengths == 1)
    if len(decode):
        parts.append(_decode_part(batch, decode))
    prompts = np.flatnonzero(lengths > 1)
    if len(prompts) and batch.routes.prefill_kernel is not None:
        return parts + [_kernel_prefill(batch, prompts)]
    parts += [_causal_prefill(batch, row) for row in np.flatnonzero((lengths > 1) & (starts == 0))]
    later = np.flatnonzero((lengths > 1) & (starts > 0))
    if len(later):
        parts.append(_later_prefill(batch, later))
    return parts


def _kernel_prefill(batch: PackedBatch, rows: np.ndarray) -> KernelPrefill:
    return KernelPrefill(batch.tensor(batch.first_token[rows]), batch.tensor(batch.starts[rows]),
                         batch.tensor(batch.lengths[rows]), batch.tensor(batch.tables[rows]),
                         batch.routes.prefill_kernel)


def _pad_block_tables(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, :len(table)] = table
    return padded


def _causal_prefill(batch: PackedBatch, row: int) -> CausalPrefill:
    first, length = int(batch.first_token[row]), int(batch.lengths[row])
    pos = np.arange(length)
    causal = pos[None, :] <= pos[:, None]
    masks = {w: batch.additive(causal & (pos[None, :] > pos[:, None] - w))
             for w in batch.windows if w is not None}
    return CausalPrefill(slice(first, first + length), masks)


def _decode_part(batch: PackedBatch, rows: np.ndarray):
    """The compiled kernel where there is one, unless every row holds the same cached leading
    blocks (and some layers attend fully, which is where sharing pays): then the shared-prefix
    kind; plain decode chunks or slots otherwise."""
    tables, starts = batch.tables[rows], batch.starts[rows]
    ends = starts + 1
    index = batch.tensor(batch.first_token[rows])
    # A lone sequence gains nothing from scoring "shared" blocks once.
    shares = None in batch.windows and len(rows) > 1
    num_shared = _num_common_blocks(tables, starts, batch.block_size) if shares else 0
    if batch.routes.decode_kernel is not None and num_shared == 0:
        return _kernel_decode(batch, index, tables, ends)
    if batch.routes.shared_decode_kernel is not None and batch.routes.decode_kernel is not None:
        windowed = _kernel_decode(batch, index, tables, ends)
        return KernelSharedDecode(index, windowed.tables, windowed.hi, num_shared, windowed,
                                  batch.routes.shared_decode_kernel)
    windowed = {w: _decode_keys(batch, tables, np.maximum(ends - w, 0), ends)
                for w in batch.windows if w is not None}
    if None not in batch.windows:
        return PagedDecode(index, windowed)
    own_from = np.full_like(ends, num_shared * batch.block_size)  # 0 when nothing is shared
    own = _decode_keys(batch, tables, own_from, ends)
    if num_shared == 0:
        return PagedDecode(index, {None: own, **windowed})
    return SharedPrefixDecode(index, len(rows), batch.tensor(tables[0, :num_shared]), own, windowed)


def _kernel_decode(batch: PackedBatch, rows: torch.Tensor, tables: np.ndarray,
                   ends: np.ndarray) -> KernelDecode:
    lo = {w: batch.tensor(np.zeros_like(ends) if w is None else np.maximum(ends - w, 0))
          for w in batch.windows}
    return KernelDecode(rows, batch.tensor(tables), lo, batch.tensor(ends), batch.routes.decode_kernel)


def _decode_keys(batch: PackedBatch, tables: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Keys [lo, hi) of each row of ``tables``, as exact slots where a sampled matmul is faster,
    else as equal-length chunks."""
    if batch.routes.exact_decode_slots:
        return _decode_slots(batch, tables, lo, hi)
    return _decode_chunks(batch, tables, lo, hi)


def _decode_slots(batch: PackedBatch, tables: np.ndarray, lo: np.ndarray,
                  hi: np.ndarray) -> DecodeSlots:
    """Every row's visible slots in position order: a sequence's once per query head of its group."""
    counts = hi - lo
    seq = np.repeat(np.arange(len(tables)), counts)
    seq_start = np.cumsum(counts) - counts
    pos = np.arange(counts.sum()) - seq_start[seq] + lo[seq]
    seq_slots = tables[seq, pos // batch.block_size] * batch.block_size + pos % batch.block_size
    # Row r = (sequence r // g, query head r % g) takes its sequence's run of seq_slots.
    row_len = np.repeat(counts, batch.queries_per_kv)
    row_start = np.cumsum(row_len) - row_len
    row_seq_start = np.repeat(seq_start, batch.queries_per_kv)
    take = np.arange(row_len.sum()) + np.repeat(row_seq_start - row_start, row_len)
    return DecodeSlots(batch.tensor(seq_slots[take]), batch.tensor(np.append(row_start, row_len.sum())),
                       len(tables))


def _decode_chunks(batch: PackedBatch, tables: np.ndarray, lo: np.ndarray,
                   hi: np.ndarray) -> DecodeChunks:
    """Chunks over keys [lo, hi) of each row of ``tables``, DECODE_CHUNK_TOKENS long (whole blocks)."""
    bs = batch.block_size
    per_chunk = max(1, DECODE_CHUNK_TOKENS // bs)
    first, last = lo // bs, (hi - 1) // bs
    num_chunks = -(-(last - first + 1) // per_chunk)
    owner = np.repeat(np.arange(len(tables)), num_chunks)
    nth = np.arange(len(owner)) - np.repeat(np.cumsum(num_chunks) - num_chunks, num_chunks)
    block_pos = (first[owner] + nth * per_chunk)[:, None] + np.arange(per_chunk)  # [N, per_chunk]
    ids = tables[owner[:, None], np.minimum(block_pos, last[owner][:, None])]
    key_pos = (block_pos[:, :, None] * bs + np.arange(bs)).reshape(len(owner), 1, -1)
    visible = (key_pos >= lo[owner][:, None, None]) & (key_pos < hi[owner][:, None, None])
    key_slots = (ids[:, :, None] * bs + np.arange(bs)).reshape(len(owner), 1, -1)
    value_slots = np.repeat(key_slots, batch.queries_per_kv, axis=1)  # one bag per query row
    return DecodeChunks(batch.tensor(owner), batch.tensor(ids.ravel()),
                        batch.tensor(np.where(visible, 0.0, -np.inf).astype(np.float32)),
                        batch.tensor(value_slots.ravel()), len(tables))


def _num_common_blocks(tables: np.ndarray, starts: np.ndarray, block_size: int) -> int:
    """Leading blocks all rows hold, complete before every row's first query position."""
    same = (tables == tables[:1]).all(axis=0)
    shared = len(same) if same.all() else int(np.argmin(same))
    return min(shared, int(starts.min()) // block_size)


def _later_prefill(batch: PackedBatch, rows: np.ndarray):
    """The shared-prefix kind when the chunks start after common leading blocks, some layers
    attend fully and the flash kernel with log-sum-exp is there (CPU); a PagedPrefill otherwise."""
    num_shared = _num_common_blocks(batch.tables[rows], batch.starts[rows], batch.block_size)
    # Without the flash kernel the unmasked part would hold every score of a long prefix.
    usable = num_shared > 0 and None in batch.windows and batch.routes.flash_lse
    if not usable:
        return _paged_prefill(batch, rows, batch.windows)
    windows = batch.windows - {None}
    return SharedPrefixPrefill(batch.tensor(batch.tables[rows[0], :num_shared]),
                               _paged_prefill(batch, rows, {None}, first_block=num_shared),
                               _paged_prefill(batch, rows, windows) if windows else None)


def _paged_prefill(batch: PackedBatch, rows: np.ndarray, windows: set,
                   first_block: int = 0) -> PagedPrefill:
    lengths, starts, first_token = batch.lengths[rows], batch.starts[rows], batch.first_token[rows]
    q_len = int(lengths.max())
    num_blocks = -(-int((starts + lengths).max()) // batch.block_size)
    j = np.arange(q_len)
    # Padded query slots repeat the sequence's last token: finite output, then discarded.
    offset = np.minimum(j[None, :], lengths[:, None] - 1)
    query_index = first_token[:, None] + offset
    valid = j[None, :] < lengths[:, None]
    masks = _prefill_masks(batch, starts[:, None] + offset, first_block * batch.block_size,
                           num_blocks * batch.block_size, windows)
    block_ids = batch.tables[rows, first_block:num_blocks].ravel()
    return PagedPrefill(batch.tensor(query_index.ravel()), batch.tensor(block_ids), masks,
                        batch.tensor(np.flatnonzero(valid.ravel())), batch.tensor(query_index[valid]),
                        len(rows), q_len)


def _prefill_masks(batch: PackedBatch, q_pos: np.ndarray, kv_from: int, kv_to: int,
                   windows: set) -> dict:
    """Additive masks per window, [B, 1, Lq * g, kv_to - kv_from], over key positions
    [kv_from, kv_to): whole blocks are read, so any key past a sequence's context is simply
    in its future."""
    k_pos = np.arange(kv_from, kv_to)[None, None, :]
    causal = k_pos <= q_pos[:, :, None]
    masks = {}
    for window in windows:
        allowed = causal if window is None else causal & (k_pos > q_pos[:, :, None] - window)
        allowed = np.repeat(allowed, batch.queries_per_kv, axis=1)  # GQA rows: g per query
        masks[window] = batch.additive(allowed)[:, None]
    return masks
