"""Teacher-forced logits of the engine's model at every position of one token sequence, by the
schedules the engine runs: the whole prompt in one step, chunked prefill, a prefix-cache hit
(the leading blocks computed by an earlier sequence with another tail) and decode steps. The
model is driven through a backend (``plan`` then ``forward`` on a ``KVCachePool``), as the
engine's model runner does."""
from __future__ import annotations

import functools

import torch

from block_manager import KVCachePool
from core.backend import Backend
from model import SeqChunk

MODES = ("whole", "chunked", "cached", "decode")
BLOCK_SIZE = 8
CHUNK = 24          # tokens per step in "chunked"
CACHED_BLOCKS = 5   # leading blocks "cached" takes from the earlier sequence
DECODE_STEPS = 32   # "decode": one step, then the last DECODE_STEPS tokens one per step


def teacher_forced_logits(backend: Backend, ids: list[int], mode: str) -> torch.Tensor:
    """[len(ids), vocab] float32: the backend's model's logits after each prefix of ``ids``."""
    cfg = backend.model.config
    blocks = 2 * -(-len(ids) // BLOCK_SIZE)
    kv = KVCachePool(cfg.num_layers, blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                     backend.model.dtype, backend.model.device, zeros=backend.kv_zeros)
    table = list(range(blocks - 1, -1, -2))  # scattered: every other block, high ids first
    if mode == "cached":
        return _after_cached_prefix(backend, kv, ids, table, list(range(0, blocks, 2)))
    spans = {"whole": [(0, len(ids))],
             "chunked": _spans(range(0, len(ids), CHUNK), len(ids)),
             "decode": _spans([0, *range(len(ids) - DECODE_STEPS, len(ids))], len(ids))}[mode]
    return torch.cat([run_span(backend, kv, ids, table, start, end) for start, end in spans])


def _spans(starts, end: int) -> list[tuple[int, int]]:
    starts = list(starts)
    return list(zip(starts, starts[1:] + [end]))


def run_span(backend: Backend, kv, ids: list[int], table: list[int], start: int,
             end: int) -> torch.Tensor:
    """One engine step of one sequence: positions [start, end), logits for all of them."""
    plan = backend.plan([SeqChunk(start, end - start, table)], BLOCK_SIZE)
    tokens = torch.tensor(ids[start:end], device=backend.model.device)
    return backend.forward(tokens, plan, kv, torch.arange(end - start, device=tokens.device))


def _after_cached_prefix(backend: Backend, kv, ids, table, other_blocks) -> torch.Tensor:
    """An earlier sequence with the same first CACHED_BLOCKS blocks and another tail computes
    them; then ``ids`` continues from those blocks in one step, as after a prefix-cache hit."""
    shared = CACHED_BLOCKS * BLOCK_SIZE
    donor = ids[:shared] + [(t + 1) % backend.model.config.vocab_size for t in ids[shared:shared + 9]]
    donor_table = table[:CACHED_BLOCKS] + other_blocks
    prefix = run_span(backend, kv, donor, donor_table, 0, len(donor))[:shared]
    return torch.cat([prefix, run_span(backend, kv, ids, table, shared, len(ids))])


@functools.lru_cache(maxsize=None)
def hf_logits(model_dir: str, ids: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """[len(ids), vocab] float32: Hugging Face's logits for ``ids`` in ``dtype`` (cached: the
    float32 reference serves every comparison)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=False).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def position_error(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[positions]: the largest |logit - reference logit| at each position."""
    assert logits.shape == reference.shape
    return (logits - reference).abs().amax(dim=-1)
