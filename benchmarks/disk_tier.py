"""The disk tier's benchmark (issue 52): one restart on the single-user checkpoint.

An engine serves a 4,096-token prompt (+ 64 new tokens) cold, writing every block it saves to
the tier (``kv_disk_write="save"``); a new engine -- a restart -- serves the same request from
the tier. Reported: time to first token of both (the ratio), whether the tokens are identical,
hash calls, the tier's load bandwidth (bytes read / time reading, verifying and copying into the
pool) against the machine's read bandwidth (a float32 sum, benchmarks/single_user.py), the CPU
and the thread count. The checkpoint is build_llama_06's body (Qwen3-0.6B's shape, vocab 2048,
bfloat16) with a context of 8,192, so prompt + new tokens fit. Each engine first serves a
32-token warm-up prompt (one-time set-up of a first forward, the same in both). Prefill runs in one step
(``max_num_batched_tokens`` above the prompt), so the cold TTFT holds no tier write: the step's
blocks are written after its token is out.

    flock /tmp/bench.lock python -m benchmarks.disk_tier --threads 2
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.cli import cpu_name
from benchmarks.single_user import LLAMA_06, read_bandwidth

PROMPT_TOKENS, NEW_TOKENS = 4096, 64


def build_checkpoint(out_dir: str, seed: int = 0) -> str:
    """build_llama_06's checkpoint with room for prompt + new tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**{**LLAMA_06, "max_position_embeddings": 8192})
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def serve(model: str, disk: str, threads: int, prompt: list[int], write: str) -> dict:
    """One engine's life: built (timed), one request, its figures."""
    from engine import LLM, SamplingParams
    started = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", num_threads=threads, skip_tokenizer_init=True,
              max_num_batched_tokens=8192, kv_disk_dir=disk, kv_disk_size=2.0, kv_disk_write=write)
    built = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # A server's first forward pays one-time set-up (kernels, tables); a short unrelated prompt
    # pays it here, in both engines alike, so the TTFTs compare prefill with loading.
    llm.generate([{"prompt_token_ids": [1] * 32}], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    stats = llm.llm_engine.engine_core.stats()
    return dict(tokens=list(out.outputs[0].token_ids), ttft=out.metrics["ttft"], built=built,
                cached=out.num_cached_tokens, stats=stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(str(Path(tmp) / "model"))
        prompt = np.random.default_rng(0).integers(3, LLAMA_06["vocab_size"], PROMPT_TOKENS).tolist()
        disk = str(Path(tmp) / "tier")
        cold = serve(model, disk, args.threads, prompt, "save")
        warm = serve(model, disk, args.threads, prompt, "evict")
        bandwidth = read_bandwidth(args.threads)
    for line in report(cold, warm, bandwidth, args.threads):
        print(line)
    return 0 if cold["tokens"] == warm["tokens"] else 1


def report(cold: dict, warm: dict, bandwidth: float, threads: int) -> list[str]:
    s, w = warm["stats"], cold["stats"]
    load_bw = s["kv_disk_bytes_read"] / max(s["kv_disk_load_seconds"], 1e-9)
    read_s = max(s["kv_disk_load_seconds"] - s["kv_disk_place_seconds"], 1e-9)
    return [
        f"{cpu_name()}, {threads} threads; prompt {PROMPT_TOKENS} tokens + {NEW_TOKENS} new, bfloat16",
        f"cold:      TTFT {cold['ttft']:.3f} s, hash calls {w['hash_computations']}, "
        f"tier writes {w['kv_disk_writes']} ({w['kv_disk_bytes_written'] / 1e6:.1f} MB), "
        f"engine built in {cold['built']:.1f} s",
        f"restarted: TTFT {warm['ttft']:.3f} s, hash calls {s['hash_computations']}, "
        f"tier hits {s['kv_disk_hits']} blocks ({warm['cached']} tokens cached), "
        f"engine built in {warm['built']:.1f} s (the weights' fingerprint included)",
        f"TTFT ratio cold / restarted: {cold['ttft'] / warm['ttft']:.1f}x; tokens identical: "
        f"{cold['tokens'] == warm['tokens']}",
        f"tier load: {s['kv_disk_bytes_read'] / 1e6:.1f} MB in {s['kv_disk_load_seconds']:.3f} s = "
        f"{load_bw / 1e9:.2f} GB/s (files in the page cache); machine read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s ({threads} threads): {load_bw / bandwidth:.1%}",
        f"  of which reading + verifying files {read_s:.3f} s ({s['kv_disk_bytes_read'] / read_s / 1e9:.2f} "
        f"GB/s), copying into the pool {s['kv_disk_place_seconds']:.3f} s (its pages' first touch)",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
