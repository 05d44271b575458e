"""Runs the bench's workloads on vLLM's CPU build; run by vLLM's own interpreter, not ours.

    VLLM_PYTHON -P vllm_script.py SPEC.json OUT.json   (-P: this folder never shadows vLLM's imports)

SPEC (written by ``peer_vllm``): model_dir, dtype, max_num_batched_tokens, max_num_seqs,
max_model_len, kv_cache_memory_bytes, repeats, warmup and workloads (each: name, prompts as
token-id lists, max_tokens). Every workload runs greedy with EOS ignored and prefix caching
on, after a warm-up, with the prefix cache reset before each of its ``repeats`` timed runs
(the fastest is kept). OUT: per workload the wall time, TTFTs, the time until every request
had its first token, and every request's output token ids. Self-contained on purpose: vLLM's
venv has none of the project.
"""
from __future__ import annotations

import json
import os
import sys
import time


def make_llm(spec: dict):
    from vllm import LLM
    return LLM(model=spec["model_dir"], tokenizer=None, skip_tokenizer_init=True,
               dtype=spec["dtype"], enable_prefix_caching=True,
               max_num_batched_tokens=spec["max_num_batched_tokens"],
               max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"], seed=0,
               kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],  # the same KV room as ours
               disable_log_stats=False)  # stats on: each output then carries its TTFT


def greedy(max_tokens: int):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompts_of(workload: dict) -> list:
    return [{"prompt_token_ids": p} for p in workload["prompts"]]


def run_workload(llm, workload: dict) -> dict:
    """One timed generate() over every prompt, the prefix cache emptied first."""
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"vLLM refused to reset its prefix cache before {workload['name']}")
    wall_start = time.time()  # vLLM's arrival times are wall-clock
    start = time.perf_counter()
    outs = llm.generate(prompts_of(workload), greedy(workload["max_tokens"]), use_tqdm=False)
    wall = time.perf_counter() - start
    ttfts = [o.metrics.first_token_latency for o in outs] if all(o.metrics for o in outs) else None
    all_first = (max(o.metrics.arrival_time + o.metrics.first_token_latency for o in outs)
                 - wall_start) if ttfts else None
    return dict(workload=workload["name"], wall_s=wall, ttfts=ttfts, all_first_s=all_first,
                outputs=[list(o.outputs[0].token_ids) for o in outs],
                num_cached_tokens=sum(o.num_cached_tokens or 0 for o in outs))


def main(spec_path: str, out_path: str) -> None:
    import vllm
    with open(spec_path) as f:
        spec = json.load(f)
    load_start = time.perf_counter()
    llm = make_llm(spec)
    startup = time.perf_counter() - load_start
    llm.generate(prompts_of(spec["warmup"]), greedy(spec["warmup"]["max_tokens"]), use_tqdm=False)
    runs = [min((run_workload(llm, w) for _ in range(spec["repeats"])), key=lambda r: r["wall_s"])
            for w in spec["workloads"]]
    result = dict(vllm_version=vllm.__version__, startup_s=startup, runs=runs,
                  max_num_batched_tokens=spec["max_num_batched_tokens"],
                  omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    if len(sys.argv) != 3:
        raise SystemExit("usage: vllm_script.py SPEC.json OUT.json")
    main(sys.argv[1], sys.argv[2])
