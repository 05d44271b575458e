"""Where our time goes (``--profile``), by phase and by op.

* prefill: dense GFLOP/s achieved over a measured matmul peak of the same dtype (the larger of
  a square n x n product and a model-shaped one: a full token budget through the MLP's up
  projection), and the top ops of a profiled prefill;
* decode: a step at batch 1 and at batch N against the weight-streaming bound (the bytes of
  every weight a step reads, divided by a measured memory bandwidth), the share of a batch-N
  step spent outside matmuls, and its top ops."""
from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from engine import LLM, SamplingParams

from .ours import engine_args, kv_bytes_per_token
from .workloads import Sizes, Workload, random_tokens, torch_dtype

# The model's linears run as oneDNN kernels on CPU float32 (model.Linear); they are matmuls too.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear", "mkldnn::_linear_pointwise", "mkldnn::_linear_pointwise.binary")
PROFILED_PREFILL_PROMPTS = 1  # prompts of workload (a) prefilled under the profiler
PREFILL_BUDGETS = 2  # the timed prefill: enough of (a)'s prompts for this many full token budgets
DECODED_BEFORE_TIMING = 3  # each request's first token and two warm-up steps (decoding_batch)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, trials: int, inner: int) -> float:
    """Best-of-trials seconds of one fn() call; the first trial is a warm-up."""
    best = math.inf
    for _ in range(trials + 1):
        sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                trials: int = 7, inner: int = 5) -> float:
    """Best-of-trials FLOP/s of (m x k) @ (k x n) products."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    c = torch.empty(m, n, dtype=dtype, device=device)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b, out=c), device, trials, inner)


def matmul_peak(n: int, dtype: torch.dtype, device: torch.device, trials: int = 7,
                inner: int = 10) -> float:
    """Best-of-trials FLOP/s of n x n x n matmuls."""
    return matmul_rate(n, n, n, dtype, device, trials, inner)


def matmul_peaks(s: Sizes, facts: dict, dtype: torch.dtype, device: torch.device) -> dict:
    """The square peak and a model-shaped one (a token budget through the MLP's up projection);
    the roof the prefill is measured against is the larger."""
    square = matmul_peak(s.matmul_n, dtype, device)
    shaped = matmul_rate(s.max_batched_tokens, facts["hidden_size"],
                         facts.get("intermediate_size") or 4 * facts["hidden_size"], dtype, device,
                         trials=3, inner=2)
    return dict(square_n=s.matmul_n, square_flop_s=square, model_shaped_flop_s=shaped,
                model_shape=f"{s.max_batched_tokens}x{facts['hidden_size']}x"
                            f"{facts.get('intermediate_size')}", peak_flop_s=max(square, shaped))


def memory_bandwidth(device: torch.device, mib: int = 512) -> dict:
    """Bytes/s of reading a large tensor (a sum) and of copying it (read + write); the larger is
    the bandwidth the decode bound uses (the more favourable to the engine: a tighter bound)."""
    n = mib * 2 ** 20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = n * 4 / best_seconds(lambda: src.sum(), device, trials=5, inner=2)
    copy = 2 * n * 4 / best_seconds(lambda: dst.copy_(src), device, trials=5, inner=2)
    return dict(tensor_mib=mib, read_bytes_s=read, copy_bytes_s=copy, bytes_s=max(read, copy))


def attention_flops(prompts: list[list[int]], facts: dict) -> int:
    """Causal QK^T and PV: 4 * layers * heads * head_dim * L(L+1)/2 per prompt of length L."""
    per_pair = 4 * facts["num_layers"] * facts["num_heads"] * facts["head_dim"]
    return sum(per_pair * len(p) * (len(p) + 1) // 2 for p in prompts)


def weight_bytes_per_step(facts: dict, dtype: str) -> int:
    """Every weight one forward reads: the layers, the final norm and the LM head (the embedding
    matrix itself when tied); the embedding lookup reads only a few rows and is left out."""
    head = facts["vocab_size"] * facts["hidden_size"]
    return (facts["params_without_embedding"] + head) * torch_dtype(dtype).itemsize


def prefill(llm: LLM, prompts: list[list[int]]) -> tuple[float, int]:
    """(seconds, prompt tokens computed) of the prompts' prefill: max_tokens=1."""
    before = llm.stats()["prompt_tokens_computed"]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - start, llm.stats()["prompt_tokens_computed"] - before


def bench_prefill(model_dir: str, w: Workload, s: Sizes, facts: dict, peak: float, dtype: str,
                  device: torch.device) -> dict:
    """Our prefill alone: the first of the workload's prompts (enough for PREFILL_BUDGETS full
    token budgets) with max_tokens=1 on a fresh LLM, then one of them again (on a fresh LLM)
    under the profiler for the top ops."""
    prompts = leading_prompts(w.prompts, PREFILL_BUDGETS * s.max_batched_tokens)
    seconds, computed = prefill(LLM(model_dir, **engine_args(w, s, model_dir, dtype, str(device))),
                                prompts)
    dense = 2 * facts["params_without_embedding"] * computed
    attn = attention_flops(prompts, facts)
    few = w.prompts[:PROFILED_PREFILL_PROMPTS]
    llm = LLM(model_dir, **engine_args(w, s, model_dir, dtype, str(device)))
    with profiler(device) as prof:
        _, profiled_tokens = prefill(llm, few)
    return dict(prompts=len(prompts), prefill_s=seconds, prompt_tokens_computed=computed,
                dense_flops=dense,
                attention_flops=attn, dense_flop_s=dense / seconds,
                matmul_peak_flop_s=peak, mfu=dense / seconds / peak,
                mfu_with_attention=(dense + attn) / seconds / peak,
                profiled_prompts=len(few), profiled_tokens=profiled_tokens,
                top_ops_ms=top_ops(prof, device, 1))


def leading_prompts(prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The first prompts that together hold at least `tokens` tokens (or all of them)."""
    total = 0
    for i, p in enumerate(prompts):
        total += len(p)
        if total >= tokens:
            return prompts[:i + 1]
    return prompts


def profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def bench_decode_overhead(llm: LLM, s: Sizes, device: torch.device, wall: float) -> dict:
    """Share of a batch-N decode step outside matmuls (torch.profiler self times).

    ``wall``: the seconds of the same number of steps run just before without the profiler, so
    the profiler's overhead does not inflate the share; its own wall-based share is given too.
    """
    with profiler(device) as prof:
        prof_wall = timed_steps(llm, s.decode_batch, s.decode_steps)
    mm_us = matmul_us(prof, device)
    return dict(batch=s.decode_batch, steps=s.decode_steps, step_ms=wall / s.decode_steps * 1e3,
                matmul_ms_per_step=mm_us / s.decode_steps / 1e3,
                non_matmul_share=max(0.0, 1 - mm_us / 1e6 / wall),
                non_matmul_share_profiled_wall=max(0.0, 1 - mm_us / 1e6 / prof_wall),
                top_ops_ms_per_step=top_ops(prof, device, s.decode_steps))


def bench_decode(model_dir: str, s: Sizes, facts: dict, dtype: str, device: torch.device,
                 bandwidth: float, peak: float) -> tuple[list[dict], dict]:
    """(a step against the bound at batch 1 and at batch N, the batch-N step's overhead)."""
    bounds, overhead = [], None
    for batch in sorted({1, s.decode_batch}):
        llm = decoding_batch(model_dir, s, facts["vocab_size"], dtype, device, batch)
        wall = timed_steps(llm, batch, s.decode_steps)
        bounds.append(decode_bound(model_dir, s, facts, dtype, batch, wall, bandwidth, peak))
        if batch == s.decode_batch:
            overhead = bench_decode_overhead(llm, s, device, wall)
    return bounds, overhead


def decode_bound(model_dir: str, s: Sizes, facts: dict, dtype: str, batch: int, wall: float,
                 bandwidth: float, peak: float) -> dict:
    """A batch-`batch` decode step against the weight-streaming bound (weight bytes / bandwidth).

    Also given: the bound with the KV the step reads added (each sequence's whole context; the
    mean context over the timed steps), and the compute floor (dense FLOPs / matmul peak).
    """
    step_s = wall / s.decode_steps
    weights = weight_bytes_per_step(facts, dtype)
    context = s.decode_prompt + DECODED_BEFORE_TIMING + s.decode_steps / 2
    kv = batch * context * kv_bytes_per_token(model_dir, dtype)
    flops = 2 * weights / torch_dtype(dtype).itemsize * batch
    return dict(batch=batch, steps=s.decode_steps, step_ms=step_s * 1e3, weight_bytes=weights,
                kv_bytes=int(kv), bandwidth_bytes_s=bandwidth,
                weight_bound_ms=weights / bandwidth * 1e3,
                weight_kv_bound_ms=(weights + kv) / bandwidth * 1e3,
                compute_floor_ms=flops / peak * 1e3,
                over_weight_bound=step_s / (weights / bandwidth))


def decoding_batch(model_dir: str, s: Sizes, vocab: int, dtype: str, device: torch.device,
                   n: int) -> LLM:
    """An LLM with n requests all past their prefill, the decode shape warmed."""
    rng = np.random.default_rng(3)
    new = 3 * s.decode_steps + 8
    llm = LLM(model_dir, block_size=16, max_num_seqs=n, max_num_batched_tokens=s.max_batched_tokens,
              num_kv_blocks=n * (-(-(s.decode_prompt + new) // 16)), dtype=dtype, device=str(device))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for _ in range(n):
        llm.add_request(random_tokens(rng, s.decode_prompt, vocab), params)
    while llm.stats()["generation_tokens"] < n:
        llm.step()
    for _ in range(DECODED_BEFORE_TIMING - 1):
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


def self_times_us(prof, device: torch.device) -> list[tuple[str, float]]:
    on_gpu = device.type == "cuda"
    return [(evt.key, evt.self_device_time_total if on_gpu else evt.self_cpu_time_total)
            for evt in prof.key_averages()]


def matmul_us(prof, device: torch.device) -> float:
    return sum(us for key, us in self_times_us(prof, device) if key in MATMUL_OPS)


def top_ops(prof, device: torch.device, per: int, n: int = 8) -> dict:
    """The top n ops by self time, in ms per `per` (steps, or 1 for the whole run)."""
    rows = sorted(self_times_us(prof, device), key=lambda r: -r[1])[:n]
    return {k: us / 1e3 / per for k, us in rows}
