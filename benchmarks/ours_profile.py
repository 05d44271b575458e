"""Where our time goes (``--profile``): prefill MFU against a measured matmul peak, and the
share of a batch-N decode step spent outside the model's matmuls."""
from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from engine import LLM, SamplingParams

from .ours import engine_args
from .workloads import Sizes, Workload, random_tokens

# The model's linears run as oneDNN kernels on CPU float32 (model.Linear); they are matmuls too.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear", "mkldnn::_linear_pointwise", "mkldnn::_linear_pointwise.binary")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(n: int, dtype: torch.dtype, device: torch.device, trials: int = 7,
                inner: int = 10) -> float:
    """Best-of-trials FLOP/s of n x n x n matmuls: the roof the prefill is measured against."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    best = math.inf
    for _ in range(trials + 1):  # the first trial is a warm-up
        sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=c)
        sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n ** 3 / best


def attention_flops(prompts: list[list[int]], facts: dict) -> int:
    """Causal QK^T and PV: 4 * layers * heads * head_dim * L(L+1)/2 per prompt of length L."""
    per_pair = 4 * facts["num_layers"] * facts["num_heads"] * facts["head_dim"]
    return sum(per_pair * len(p) * (len(p) + 1) // 2 for p in prompts)


def bench_prefill(model_dir: str, w: Workload, s: Sizes, facts: dict, peak: float, dtype: str,
                  device: torch.device) -> dict:
    """Our prefill alone: the workload's prompts with max_tokens=1 on a fresh LLM."""
    llm = LLM(model_dir, **engine_args(w, s, model_dir, dtype, str(device)))
    before = llm.stats()["prompt_tokens_computed"]
    start = time.perf_counter()
    llm.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    seconds = time.perf_counter() - start
    computed = llm.stats()["prompt_tokens_computed"] - before
    dense = 2 * facts["params_without_embedding"] * computed
    attn = attention_flops(w.prompts, facts)
    return dict(prefill_s=seconds, prompt_tokens_computed=computed, dense_flops=dense,
                attention_flops=attn, dense_flop_s=dense / seconds,
                matmul_peak_flop_s=peak, mfu=dense / seconds / peak,
                mfu_with_attention=(dense + attn) / seconds / peak)


def bench_decode_overhead(model_dir: str, s: Sizes, vocab: int, dtype: str,
                          device: torch.device) -> dict:
    """Share of a batch-N decode step outside matmuls (torch.profiler self times).

    The step time comes from the same number of steps run without the profiler, so the
    profiler's overhead does not inflate the share; its own wall-based share is reported too.
    """
    from torch.profiler import ProfilerActivity, profile

    llm = decoding_batch(model_dir, s, vocab, dtype, device)
    wall = timed_steps(llm, s.decode_batch, s.decode_steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        prof_wall = timed_steps(llm, s.decode_batch, s.decode_steps)
    mm_us, top = matmul_time(prof, device, s.decode_steps)
    return dict(batch=s.decode_batch, steps=s.decode_steps, step_ms=wall / s.decode_steps * 1e3,
                matmul_ms_per_step=mm_us / s.decode_steps / 1e3,
                non_matmul_share=max(0.0, 1 - mm_us / 1e6 / wall),
                non_matmul_share_profiled_wall=max(0.0, 1 - mm_us / 1e6 / prof_wall),
                top_ops_ms_per_step=top)


def decoding_batch(model_dir: str, s: Sizes, vocab: int, dtype: str, device: torch.device) -> LLM:
    """An LLM with decode_batch requests all past their prefill, the decode shape warmed."""
    rng = np.random.default_rng(3)
    n, new = s.decode_batch, 3 * s.decode_steps + 8
    llm = LLM(model_dir, block_size=16, max_num_seqs=n, max_num_batched_tokens=s.max_batched_tokens,
              num_kv_blocks=n * (-(-(s.decode_prompt + new) // 16)), dtype=dtype, device=str(device))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for _ in range(n):
        llm.add_request(random_tokens(rng, s.decode_prompt, vocab), params)
    while llm.stats()["generation_tokens"] < n:
        llm.step()
    for _ in range(2):
        llm.step()
    return llm


def timed_steps(llm: LLM, n: int, steps: int) -> float:
    """Seconds for `steps` decode steps, as steps x the median step (robust to a busy box)."""
    before = llm.stats()["generation_tokens"]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    made = llm.stats()["generation_tokens"] - before
    if made != n * steps:
        raise RuntimeError(f"decode steps were not all batch {n}: {made} tokens in {steps} steps")
    return statistics.median(times) * steps


def matmul_time(prof, device: torch.device, steps: int) -> tuple[float, dict]:
    """(matmul self time in µs, the top ops by self time in ms per step)."""
    on_gpu = device.type == "cuda"
    rows = [(evt.key, evt.self_device_time_total if on_gpu else evt.self_cpu_time_total)
            for evt in prof.key_averages()]
    mm = sum(us for key, us in rows if key in MATMUL_OPS)
    top = dict(sorted(((k, u / 1e3 / steps) for k, u in rows), key=lambda r: -r[1])[:8])
    return mm, top
