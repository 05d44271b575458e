"""(c) The prefix-cache hash chain alone: our two hash strategies, and HF's prefix matcher.

Three cases on one long prompt, block 16, each the median of many lookups:
cold = the first lookup of a fresh request whose whole prefix is cached; re-lookup = the same
request looked up again (an admission retry); empty cache = a first lookup with nothing cached.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from engine import LLM, SamplingParams

BLOCK = 16


def engine_prefix_lookup(llm: LLM):
    """The one reach into engine internals here: (new_sequence, lookup -> hit blocks).

    The engine has no public "look this prompt up" call, and the chapter's lookup is what (c)
    times, so this takes it from where it lives: ``llm.prefix_cache._lookup_prefix_cache`` on
    a bare ``scheduler.Sequence``. Adjust here if the prefix cache's internals move.
    """
    from scheduler import Sequence

    def lookup(seq) -> int:
        return len(llm.prefix_cache._lookup_prefix_cache(seq).blocks)

    return Sequence, lookup


def time_lookups(llm: LLM, lookup, seqs: list) -> dict:
    """Median µs and hash computations of one lookup per sequence, and the hit length."""
    times, hashes, hit = [], [], 0
    for seq in seqs:
        h0 = llm.stats()["hash_computations"]
        t = time.perf_counter()
        hit = lookup(seq)
        times.append(time.perf_counter() - t)
        hashes.append(llm.stats()["hash_computations"] - h0)
    return dict(us=statistics.median(times) * 1e6, hashes=int(statistics.median(hashes)),
                hit_blocks=hit)


def bench_hash_ours(model_dir: str, tokens: list[int], strategy: str, reps: int, dtype: str,
                    device) -> dict:
    """Empty cache, then (after one prefill of the prompt) cold and re-lookup."""
    n = len(tokens)
    llm = LLM(model_dir, block_size=BLOCK, num_kv_blocks=n // BLOCK + 8, max_num_seqs=4,
              max_num_batched_tokens=2048, max_model_len=n + 8, dtype=dtype, device=str(device),
              hash_strategy=strategy)
    new_sequence, lookup = engine_prefix_lookup(llm)
    arr = np.asarray(tokens, dtype=np.int64)
    empty = time_lookups(llm, lookup, [new_sequence(arr) for _ in range(reps)])
    llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    cold = time_lookups(llm, lookup, [new_sequence(arr) for _ in range(reps)])
    seq = new_sequence(arr)
    lookup(seq)  # its first lookup; what follows is a re-lookup
    relook = time_lookups(llm, lookup, [seq] * reps)
    return dict(system=f"ours ({strategy})", cold_us=cold["us"], cold_hashes=cold["hashes"],
                cold_hit_blocks=cold["hit_blocks"], relookup_us=relook["us"],
                relookup_hashes=relook["hashes"], empty_cache_us=empty["us"],
                empty_cache_hashes=empty["hashes"])


# ----------------------------------------------------------------------------- HF's matcher

def hf_matcher(model_dir: str):
    """HF's full-attention cache allocator, built with its public constructor.

    No cache tensor is registered: ``match_prefix_blocks`` reads only the page size and the
    block ledger, so the timing is the matcher and its blake2b chain alone.
    """
    from transformers import AutoConfig
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator)
    cfg = AutoConfig.from_pretrained(model_dir)
    return FullAttentionCacheAllocator(
        index=0, config=cfg, num_key_value_heads=cfg.num_key_value_heads,
        cache_dtype=torch.float32, page_size=BLOCK,
        layer_indices=list(range(cfg.num_hidden_layers)), allow_block_sharing=True)


def hf_block_hash():
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (
        compute_block_hash)
    return compute_block_hash


def register_chain(alloc, tokens: list[int]) -> None:
    """Ledger entries for every full block, as if the prompt had been computed once."""
    block_hash, parent = hf_block_hash(), None
    for b in range(len(tokens) // BLOCK):
        parent = block_hash(parent, tokens[b * BLOCK:(b + 1) * BLOCK])
        alloc.ledger.register_new_hash(b, parent)


def count_calls(code, fn) -> int:
    """How many times the function with this code object runs during fn() (sys.setprofile)."""
    calls = [0]

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls[0] += 1

    sys.setprofile(watch)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def bench_hash_hf(model_dir: str, tokens: list[int], reps: int) -> dict:
    """HF keeps no per-request chain: every match (first or repeated) rebuilds it."""
    alloc, code = hf_matcher(model_dir), hf_block_hash().__code__
    match = lambda: alloc.match_prefix_blocks(tokens)  # noqa: E731
    empty_us, empty_hashes = median_us(match, reps), count_calls(code, match)
    register_chain(alloc, tokens)
    cold_us, hashes = median_us(match, reps), count_calls(code, match)
    return dict(system="HF match_prefix_blocks (blake2b)", cold_us=cold_us, cold_hashes=hashes,
                cold_hit_blocks=len(match()), relookup_us=cold_us, relookup_hashes=hashes,
                empty_cache_us=empty_us, empty_cache_hashes=empty_hashes)
