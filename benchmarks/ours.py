"""This engine's runner: a fresh ``LLM`` per workload, timed over one ``generate()``."""
from __future__ import annotations

import json
import os
import time

import torch

from engine import LLM, SamplingParams

from .result import RunResult, check_lengths
from .threads import DEFAULT
from .workloads import Sizes, Workload, kv_capacity_tokens, torch_dtype, warmup_workload

SYSTEM = "ours"
BUSY_SYSTEM = "ours, busy neighbour"  # ours again, one CPU-bound process running beside it
PLAIN_SYSTEM = "ours (plain)"  # fast_paths=False: model.py's plain attention and linears only
COUNTERS = ("prompt_tokens_computed", "prompt_tokens_cached", "prefix_cache_queries",
            "prefix_cache_hits", "hash_computations", "steps", "preemptions")


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V of one token in every layer, from the checkpoint's config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem


def engine_args(w: Workload, s: Sizes, model_dir: str, dtype: str, device: str,
                fast_paths: bool = True) -> dict:
    return dict(block_size=16, kv_cache_memory=kv_capacity_tokens(w) * kv_bytes_per_token(model_dir, dtype),
                max_num_seqs=256, max_num_batched_tokens=s.max_batched_tokens,
                dtype=dtype, device=device, seed=0, enable_prefix_caching=True,
                hash_strategy="incremental", fast_paths=fast_paths)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_ours(model_dir: str, w: Workload, s: Sizes, dtype: str, device: torch.device,
             threads: str, system: str = SYSTEM) -> RunResult:
    """A fresh LLM (so the prefix cache starts cold), timed over one full generate()."""
    args = engine_args(w, s, model_dir, dtype, str(device), fast_paths=system != PLAIN_SYSTEM)
    if threads != DEFAULT:
        args["num_threads"] = int(threads)
    llm = LLM(model_dir, **args)
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(w.prompts, greedy(w.max_new_tokens), use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    check_lengths(system, outputs, w)
    return RunResult(w.name, system, threads, wall, w.prompt_tokens, w.output_tokens,
                     ttfts=[o.metrics["ttft"] for o in outs],
                     all_first_s=max(o.metrics["first_token_time"] for o in outs) - start,
                     outputs=outputs, settings=", ".join(f"{k}={v}" for k, v in args.items()),
                     compute_threads=torch.get_num_threads(),
                     extra={k: after[k] - before[k] for k in COUNTERS})


def warmup_ours(model_dir: str, s: Sizes, vocab: int, dtype: str, device: torch.device,
                fast_paths: bool = True) -> None:
    w = warmup_workload(vocab)
    llm = LLM(model_dir, **engine_args(w, s, model_dir, dtype, str(device), fast_paths))
    llm.generate(w.prompts, greedy(w.max_new_tokens), use_tqdm=False)
