"""Where one user's decode token goes: each compiled kernel timed by a wrapper, the rest by
difference, beside the weight-streaming bound.

    python -m benchmarks.decode_split [--model CKPT] [--threads 1,2] [--steps 40]

The default checkpoint is the single-user one (benchmarks/single_user.py, built on the fly).
One sequence decodes after a 128-token prompt; per step: the few-row linears, the decode
attention kernel, the norm / RoPE kernels, the rest of the forward (embedding, residual adds,
Python between kernels) and what runs outside the forward (plan, sampling, commit). The read
bandwidth is a float32 sum over 1 GiB (a read-only stream, as the linears' weights are).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time

import numpy as np
import torch

KERNELS = {"decode_layer": "decoder layers, one fused call each (its kernels not timed apart)",
           "small_linear": "linears (few-row kernel)", "int8_linear": "linears (8-bit few-row kernel)",
           "block_linear": "linears (block-format kernel)",
           "decode_attention": "attention (decode kernel)", "rms_norm": "norms", "norm_rope": "q/k norm + RoPE"}


def read_bandwidth() -> float:
    data = torch.ones((1 << 30) // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return (1 << 30) / best


def wrap_kernels(spent: collections.Counter) -> None:
    """Time every call of the compiled kernels (the fast layer binds them when an engine is built)."""
    from fast.kernels import compiled_kernels
    module = compiled_kernels().module

    def timed(label, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start
        return call

    for name, label in KERNELS.items():
        if hasattr(module, name):
            setattr(module, name, timed(label, getattr(module, name)))


def measure(model: str, threads: int, steps: int, quantization: str | None) -> list[str]:
    from engine import LLM, SamplingParams
    torch.set_num_threads(threads)
    bandwidth, spent = read_bandwidth(), collections.Counter()
    wrap_kernels(spent)
    eng = LLM(model, dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=128,
              quantization=quantization).llm_engine
    weights = sum(p.numel() * p.element_size() for n, p in eng.engine_core.model.named_parameters()
                  if "embed" not in n)
    vocab = eng.model_config.get_vocab_size()
    prompt = np.random.default_rng(0).integers(3, vocab - 1, size=128).tolist()
    eng.add_request("r", {"prompt_token_ids": prompt},
                    SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(6):
        eng.step()
    backend, forward, times = eng.engine_core.model_runner.backend, None, []
    forward = backend.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent["forward"] += time.perf_counter() - start

    backend.forward = timed_forward
    spent.clear()
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    step, mean = statistics.median(times), sum(times) / steps
    bound = bandwidth / weights
    lines = [f"threads {threads}: read bandwidth {bandwidth / 1e9:.1f} GB/s; weights per token "
             f"{weights / 1e9:.3f} GB; bound {bound:.1f} tok/s",
             f"  step: median {step * 1e3:.2f} ms = {1 / step:.1f} tok/s ({1 / step / bound:.0%} of the bound); "
             f"mean {mean * 1e3:.2f} ms, split below"]
    in_forward = spent.pop("forward") / steps
    kernels = 0.0
    for label, total in spent.most_common():
        per = total / steps
        kernels += per
        lines.append(f"  {label}: {per * 1e3:.2f} ms ({per / mean:.0%})")
    lines.append(f"  rest of the forward: {(in_forward - kernels) * 1e3:.2f} ms ({(in_forward - kernels) / mean:.0%})")
    lines.append(f"  outside the forward: {(mean - in_forward) * 1e3:.2f} ms ({(mean - in_forward) / mean:.0%})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_split", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: the single-user checkpoint, built)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--quantization", choices=["int8", "int4", "q8_0"])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="decode_split_") as tmp:
        if args.model is None:
            from benchmarks.single_user import build_llama_06
            args.model = build_llama_06(tmp)
        for threads in (int(t) for t in args.threads.split(",")):
            print("\n".join(measure(args.model, threads, args.steps, args.quantization)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
