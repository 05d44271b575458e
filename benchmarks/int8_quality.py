"""The 8-bit weights' quality standard (``python -m benchmarks.int8_quality``): an engine's
log-probabilities against the float32 engine's, teacher-forced over a fixed text.

For each of 256 positions the text's next token is scored: the mean and the largest
|log p(token) - log p_float32(token)|, and how often the greedy (argmax) token equals the float32
engine's. tests/test_int8.py holds the int8 engine to a bound set from these figures; the bench
prints them beside llama.cpp's Q8_0 when its logits are given (``--llamacpp-logits FILE.npy``,
the same token ids evaluated by llama.cpp).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from core.backend import Backend
from model import load_model
from tools.teacher_forced import teacher_forced_logits

CPU = torch.device("cpu")
POSITIONS = 256
TEXT = (
    "A model stores a key and a value vector for every token it reads: the cache of keys and "
    "values, cut into blocks of sixteen tokens. Requests that start with the same tokens can "
    "share blocks. The prefix cache finds them: it names every full block by a chain hash, the "
    "hash of the block's tokens seeded with the hash of the block before it, so that one hash "
    "names the whole prefix, and it keeps a map from hash to block. When a new request arrives, "
    "the scheduler looks its prompt up in that map, block by block, and stops at the first miss. "
    "Every block it finds is shared instead of computed again, so the request starts its prefill "
    "after the cached prefix. The chapter's point is where the chain lives: each sequence keeps "
    "its own list of block hashes and the hash of its last full block, so a lookup and a save "
    "never rebuild the chain from the first token. A long prompt of four thousand tokens holds "
    "two hundred and fifty six blocks, and the old way hashed every one of them at each lookup. "
    "Once upon a time there was a little engine that read the same story again and again, and "
    "every time it remembered a little more of it, until the whole story was in its blocks."
)


def text_ids(model_dir: str, length: int = POSITIONS + 1) -> list[int]:
    """The fixed text's first ``length`` token ids (the text repeated if it is shorter)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def engine_logits(model_dir: str, ids: list[int], dtype: torch.dtype, quantization: str | None = None,
                  fast: bool = True) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of this engine, the whole text in one forward."""
    from fast.backend import FastBackend
    model = load_model(model_dir, dtype, CPU, quantization=quantization)
    backend = FastBackend(model) if fast else Backend(model)
    return teacher_forced_logits(backend, ids, "whole")


def logprob_error(logits, reference, ids: list[int]) -> dict:
    """Mean and max |log p - log p_ref| of each next token, and the greedy tokens' agreement."""
    logits, reference = torch.as_tensor(logits).float(), torch.as_tensor(reference).float()
    n = min(POSITIONS, len(ids) - 1)
    target = torch.tensor(ids[1:n + 1])
    got = logits[:n].log_softmax(-1).gather(1, target[:, None])[:, 0]
    want = reference[:n].log_softmax(-1).gather(1, target[:, None])[:, 0]
    err = (got - want).abs()
    agree = (logits[:n].argmax(-1) == reference[:n].argmax(-1)).float().mean()
    return {"mean": err.mean().item(), "max": err.max().item(), "agreement": agree.item()}


def rows(model_dir: str, llamacpp: dict[str, str] | None = None) -> list[tuple[str, dict]]:
    """(system, figures) for this engine in bfloat16, int8 (fast and plain) and any llama.cpp
    logits given (name -> .npy of the same ids), each against the float32 engine."""
    ids = text_ids(model_dir)
    reference = engine_logits(model_dir, ids, torch.float32)
    out = [("this engine, bfloat16", logprob_error(engine_logits(model_dir, ids, torch.bfloat16), reference, ids)),
           ("this engine, int8 weights (bfloat16)",
            logprob_error(engine_logits(model_dir, ids, torch.bfloat16, "int8"), reference, ids)),
           ("this engine, int8 weights (float32)",
            logprob_error(engine_logits(model_dir, ids, torch.float32, "int8"), reference, ids))]
    for name, path in (llamacpp or {}).items():
        out.append((name, logprob_error(np.load(path)[:len(ids)], reference, ids)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "demo_model"))
    p.add_argument("--ids-out", help="write the text's token ids (JSON) for llama.cpp to evaluate")
    p.add_argument("--llamacpp-logits", action="append", default=[], metavar="NAME=FILE.npy")
    args = p.parse_args(argv)
    if args.ids_out:
        Path(args.ids_out).write_text(json.dumps(text_ids(args.model)))
        return 0
    given = dict(item.split("=", 1) for item in args.llamacpp_logits)
    print(f"| system | mean abs logprob error | max | greedy agreement ({POSITIONS} tokens) |")
    print("|---|---:|---:|---:|")
    for name, r in rows(args.model, given):
        print(f"| {name} | {r['mean']:.4f} | {r['max']:.4f} | {r['agreement']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
