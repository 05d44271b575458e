"""Peer: Hugging Face ``model.generate_batch`` (continuous batching on its paged cache)."""
from __future__ import annotations

import logging
import time

import torch

from .peer_hf_generate import greedy_config
from .result import RunResult, check_lengths
from .workloads import (HF_ATTENTION, HF_PAGE_SIZE, Sizes, Workload, kv_capacity_tokens, load_hf,
                        torch_dtype, warmup_workload)

SYSTEM = "HF generate_batch"


def quiet_cb_logs() -> None:
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.setLevel(logging.ERROR)
    # On CPU without psutil, HF logs an error for a memory breakdown it does not need here
    # (num_blocks and max_batch_tokens are given explicitly).
    cb_logger.addFilter(lambda rec: "psutil" not in rec.getMessage())


def cb_config(w: Workload, s: Sizes):
    from transformers import ContinuousBatchingConfig
    # Sized like ours: the same KV room in tokens, the same per-forward token budget.
    return ContinuousBatchingConfig(page_size=HF_PAGE_SIZE,
                                    num_blocks=kv_capacity_tokens(w) // HF_PAGE_SIZE,
                                    max_batch_tokens=s.max_batched_tokens,
                                    allow_block_sharing=True, scheduler_type="fifo", seed=0)


def generate_batch(model, w: Workload, s: Sizes, record_timestamps: bool = False) -> dict:
    with torch.inference_mode():
        return model.generate_batch(w.prompts, generation_config=greedy_config(w.max_new_tokens),
                                    continuous_batching_config=cb_config(w, s),
                                    record_timestamps=record_timestamps, progress_bar=False)


def run_hf_generate_batch(model_dir: str, w: Workload, s: Sizes, dtype: str,
                          device: torch.device, threads: str) -> RunResult:
    quiet_cb_logs()
    model = load_hf(model_dir, torch_dtype(dtype), device)
    start = time.perf_counter()
    res = generate_batch(model, w, s, record_timestamps=True)
    wall = time.perf_counter() - start
    results = list(res.values())  # in submission order
    errors = [r.error for r in results if r.error]
    if len(results) != len(w.prompts) or errors:
        raise RuntimeError(f"{SYSTEM} on {w.name}: {len(results)}/{len(w.prompts)} results, "
                           f"errors: {errors[:1]}")
    outputs = [list(r.generated_tokens) for r in results]
    check_lengths(SYSTEM, outputs, w)
    stamped = all(r.timestamps for r in results)
    cb = cb_config(w, s)
    settings = (f"generate_batch, ContinuousBatchingConfig(page_size={cb.page_size}, "
                f"num_blocks={cb.num_blocks}, max_batch_tokens={cb.max_batch_tokens}, "
                f"allow_block_sharing={cb.allow_block_sharing}, scheduler={cb.scheduler_type}), "
                f"TTFT = timestamps[0] - created_time, greedy, eos disabled, "
                f"attn_implementation={HF_ATTENTION}")
    return RunResult(w.name, SYSTEM, threads, wall, w.prompt_tokens, w.output_tokens,
                     ttfts=[r.timestamps[0] - r.created_time for r in results] if stamped else None,
                     all_first_s=max(r.timestamps[0] for r in results) - start if stamped else None,
                     outputs=outputs, settings=settings, compute_threads=torch.get_num_threads())


def warmup_hf_generate_batch(model_dir: str, s: Sizes, vocab: int, dtype: str,
                             device: torch.device) -> None:
    quiet_cb_logs()
    model = load_hf(model_dir, torch_dtype(dtype), device)
    generate_batch(model, warmup_workload(vocab), s)
