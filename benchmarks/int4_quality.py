"""The 4-bit weights' quality standard, beside llama.cpp's Q4_0 on the same checkpoint:
``python -m benchmarks.int4_quality --model HF_DIR --llama-cpp DIR --gguf NAME=FILE.gguf ...``.

Every system is held to the same reference, this engine in float32 on the checkpoint's own
weights (the plain path), teacher-forced over one chunk of a fixed text: llama.cpp's
``llama-perplexity`` evaluates each GGUF given (the checkpoint converted and quantized, e.g.
``llama-quantize --pure ... Q4_0``) and saves its log-probabilities of the chunk's last 256
positions (benchmarks/gguf_compare.py reads them); this engine evaluates the same token ids in
bfloat16 on the fast path with each weight format quantized at load (``int4``, ``q8_0``,
``int8``). Printed per system: the mean and the largest |log p(next token) - the reference's|,
and how often its top token is the reference's. The standard: int4's figures no worse than
llama.cpp Q4_0's.

Never run in CI: it needs a llama.cpp build. Without ``--llama-cpp`` only this engine's rows are
printed (on the text's ids as the checkpoint's tokenizer reads them).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.gguf_compare import first, llama_perplexity, read_kld, run_llama_cpp
from benchmarks.int8_quality import text_ids
from core.backend import Backend
from model import load_model
from tools.teacher_forced import teacher_forced_logits

FORMATS = ("int4", "q8_0", "int8")


def our_logprobs(model_dir: str, ids: list[int], dtype: torch.dtype, quantization: str | None,
                 fast: bool) -> np.ndarray:
    """[positions, vocab] log-probabilities from the chunk's middle (llama.cpp's saved rows)."""
    from fast.backend import FastBackend
    model = load_model(model_dir, dtype, torch.device("cpu"), quantization=quantization)
    backend = FastBackend(model) if fast else Backend(model)
    logits = teacher_forced_logits(backend, ids, "whole")[first(ids):len(ids) - 1]
    return logits.float().log_softmax(-1).numpy()


def against(logprobs: np.ndarray, reference: np.ndarray, ids: list[int]) -> dict:
    target = np.asarray(ids[first(ids) + 1:])[:, None]
    err = np.abs(np.take_along_axis(logprobs, target, 1) - np.take_along_axis(reference, target, 1))
    return {"mean": float(err.mean()), "max": float(err.max()),
            "agreement": float((logprobs.argmax(1) == reference.argmax(1)).mean())}


def rows(model_dir: str, ids: list[int], theirs: dict[str, np.ndarray]) -> list[tuple[str, dict]]:
    reference = our_logprobs(model_dir, ids, torch.float32, None, fast=False)
    out = [(f"this engine, {fmt} (bfloat16, fast path)",
            against(our_logprobs(model_dir, ids, torch.bfloat16, fmt, fast=True), reference, ids))
           for fmt in FORMATS]
    out.append(("this engine, bfloat16 (fast path)",
                against(our_logprobs(model_dir, ids, torch.bfloat16, None, fast=True), reference, ids)))
    out += [(name, against(logprobs, reference, ids)) for name, logprobs in theirs.items()]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int4_quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the Hugging Face checkpoint directory")
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp build folder (holding llama-perplexity)")
    p.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE.gguf",
                   help="a GGUF of the same checkpoint, e.g. 'llama.cpp Q4_0=model-q4_0.gguf'")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    theirs, ids = {}, None
    folder = Path(tempfile.mkdtemp(prefix="int4_quality_"))
    try:
        for i, item in enumerate(args.gguf if args.llama_cpp else []):
            name, path = item.split("=", 1)
            kld = run_llama_cpp(llama_perplexity(args.llama_cpp), Path(path), args.threads, folder / f"{i}.kld")
            got_ids, logprobs, _ = read_kld(kld)
            if ids is not None and got_ids != ids:
                raise ValueError(f"{path} read the text as other token ids than the first GGUF")
            ids, theirs[name] = got_ids, logprobs
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if ids is None:
        ids = text_ids(args.model, 514)
    print(f"{args.model}: {len(ids) - 1 - first(ids)} teacher-forced positions, against this engine in float32\n")
    print("| system | mean abs dlogp (next token) | max | same top token |")
    print("|---|---:|---:|---:|")
    for name, r in rows(args.model, ids, theirs):
        print(f"| {name} | {r['mean']:.4f} | {r['max']:.4f} | {r['agreement']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
