"""The low-precision standard at the bench's model sizes (``python -m benchmarks.low_precision``).

tests/test_low_precision.py holds the engine's bfloat16 logits to Hugging Face's own bfloat16
error on small checkpoints; this runs the same measurement on the bench's random Qwen3 shapes
(42M, Qwen3-0.6B's) and prints a table: per position, the largest |logit - HF float32 logit|,
its mean and max over the prompt, for HF in bfloat16 and for this engine in bfloat16 by every
schedule it runs (whole prompt, chunked prefill, after a prefix-cache hit, decode steps), fast
paths on and off, and each one's ratio to HF's. Also the greedy tokens' agreement over the
prompt (teacher-forced argmax equal to HF float32's).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from benchmarks.workloads import MODEL_SHAPES, build_checkpoint, random_tokens
from core.backend import Backend
from fast.backend import FastBackend
from model import load_model
from tools.teacher_forced import MODES, hf_logits, position_error, teacher_forced_logits

CPU = torch.device("cpu")


def rows_for(size: str, model_dir: str, prompt_len: int, dtype: torch.dtype) -> list[dict]:
    ids = tuple(random_tokens(np.random.default_rng(5), prompt_len, MODEL_SHAPES[size]["vocab_size"]))
    reference = hf_logits(model_dir, ids, torch.float32)
    hf_low = hf_logits(model_dir, ids, dtype)
    hf_err = position_error(hf_low, reference)
    rows = [row(size, "HF", "-", hf_low, reference, hf_err)]
    model = load_model(model_dir, dtype, CPU)
    for system, backend in (("ours", FastBackend(model)), ("ours (plain)", Backend(model))):
        for mode in MODES:
            logits = teacher_forced_logits(backend, list(ids), mode)
            rows.append(row(size, system, mode, logits, reference, hf_err))
        del backend
    return rows


def row(size, system, mode, logits, reference, hf_err) -> dict:
    err = position_error(logits, reference)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return dict(size=size, system=system, mode=mode, mean=err.mean().item(), max=err.max().item(),
                mean_ratio=err.mean().item() / hf_err.mean().item(),
                max_ratio=err.max().item() / hf_err.max().item(), argmax_agree=agree)


def markdown(rows: list[dict], dtype: str, prompt_len: int) -> str:
    lines = [f"bfloat16 logit error against HF float32, teacher-forced, {prompt_len}-token prompt "
             f"(dtype {dtype}; torch threads {torch.get_num_threads()})", "",
             "| model | system | schedule | mean error | max error | mean ÷ HF's | max ÷ HF's | argmax = HF fp32 |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['system']} | {r['mode']} | {r['mean']:.4f} | {r['max']:.4f} | "
                     f"{r['mean_ratio']:.2f} | {r['max_ratio']:.2f} | {r['argmax_agree']:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-sizes", default="42m,0.6b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--prompt-len", type=int, default=160)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in args.model_sizes.split(","):
            model_dir = build_checkpoint(os.path.join(root, size), MODEL_SHAPES[size])
            rows += rows_for(size, model_dir, args.prompt_len, dtype)
    print(markdown(rows, args.dtype, args.prompt_len))


if __name__ == "__main__":
    main()
