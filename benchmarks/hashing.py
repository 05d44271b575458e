"""(c) The prefix-cache hash chain alone: our two hash strategies, and HF's prefix matcher.

Three cases on one long prompt, block 16, each the median of many lookups:
cold = the first lookup of a fresh request whose whole prefix is cached; re-lookup = the same
request looked up again (an admission retry); empty cache = a first lookup with nothing cached.

And the block hash algorithms (``prefix_caching_hash_algo``; ``python -m benchmarks.hashing``):
µs per chained block hash, and per prompt the first lookup (the chain) and a re-lookup of the
same Sequence under both strategies -- what the chapter's incremental chain saves grows with
the price of one hash.
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
    cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
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


# ----------------------------------------------------------------------------- the algorithms

ALGOS = ("xxh3_64", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def hash_fn_of(algo: str):
    """The prefix cache's hash function for one algorithm (xxh3_64: the engine's own chain)."""
    import xxhash

    from vllm_api.block_hash import VllmBlockHash
    return xxhash.xxh3_64_intdigest if algo == "xxh3_64" else VllmBlockHash(algo)


def per_block_us(fn, blocks: list[bytes], reps: int) -> float:
    """Median µs of one chained block hash (each run hashes every block once, chained)."""
    def chain():
        parent = 0
        for data in blocks:
            parent = fn(data, parent)
    return median_us(chain, reps) / len(blocks)


def lookup_us(fn, tokens: list[int], strategy: str, reps: int) -> tuple[float, float]:
    """Median µs of a first lookup (a new Sequence: its whole chain) and of a re-lookup of the
    same Sequence, model-free, cache empty (so each lookup stops at its first probe: what is
    left is hashing), with ``strategy`` and hash ``fn``."""
    from block_manager import BlockManager
    from prefix_cache import PrefixCache
    from scheduler import Sequence

    arr = np.asarray(tokens, dtype=np.int64)
    cache = PrefixCache(BlockManager(num_blocks=len(tokens) // BLOCK + 2, block_size=BLOCK),
                        strategy, fn)
    cold = median_us(lambda: cache.lookup(Sequence(arr, 1)), reps)
    seq = Sequence(arr, 1)
    cache.lookup(seq)
    return cold, median_us(lambda: cache.lookup(seq), reps)


def bench_hash_algos(tokens: list[int], reps: int) -> list[dict]:
    """Per algorithm: µs per block, and per prompt cold / re-lookup under both strategies."""
    blocks = [np.asarray(tokens[i:i + BLOCK], dtype=np.int64).tobytes()
              for i in range(0, len(tokens) - BLOCK + 1, BLOCK)]
    rows = []
    for algo in ALGOS:
        fn = hash_fn_of(algo)
        row = dict(algo=algo, blocks=len(blocks), block_us=per_block_us(fn, blocks, reps))
        for strategy in ("incremental", "recompute"):
            row[f"{strategy}_cold_us"], row[f"{strategy}_relookup_us"] = lookup_us(
                fn, tokens, strategy, reps)
        rows.append(row)
    return rows


def algo_table(rows: list[dict]) -> str:
    lines = [f"| algorithm | µs per block | {rows[0]['blocks']}-block prompt, first lookup (its chain) | "
             "same Sequence again, incremental | same Sequence again, recompute |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['algo']} | {r['block_us']:.2f} | {r['incremental_cold_us']:.0f} | "
                     f"{r['incremental_relookup_us']:.0f} | {r['recompute_relookup_us']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="block hash algorithms: cost per block and "
                                                 "per prompt, incremental vs recompute")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompt = np.random.default_rng(4).integers(3, 30000, args.prompt).tolist()
    print(f"{args.prompt}-token prompt, block {BLOCK}, median of {args.reps}, one thread")
    print(algo_table(bench_hash_algos(prompt, args.reps)))
