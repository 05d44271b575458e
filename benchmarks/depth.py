"""One user at depth: decoding after a long context, and a follow-up prompt after a cached one,
this engine in each weight format beside llama.cpp (``llama-bench -d``), in one run.

    python -m benchmarks.depth [--model CKPT] [--threads 1,2] [--depth 4096] [--follow 512] \\
        [--llamacpp-bin DIR --gguf NAME=FILE.gguf ...]

Rows, tok/s: "decode after DEPTH tokens" (one sequence decodes NEW tokens after a DEPTH-token
prompt; ours: the prompt cached, then the time of NEW + 1 tokens less the time of 1; llama.cpp:
``tg NEW @ d DEPTH``) and "FOLLOW-token follow-up after a cached DEPTH" (ours: a prompt of the
cached DEPTH tokens and FOLLOW new ones, its first token's time; llama.cpp: ``pp FOLLOW @ d
DEPTH``, the depth's K/V kept). The default checkpoint is the single-user one with room for the
depth (max_position_embeddings 8,192), built on the fly; the machine is printed first.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cli import cpu_line
from benchmarks.single_user import LLAMA_06, prompts

FORMATS = {"ours bf16": None, "ours int8": "int8", "ours int4": "int4", "ours q8_0": "q8_0"}


def rows(depth: int, follow: int) -> tuple[str, str]:
    return f"decode after {depth} tokens", f"{follow}-token follow-up after a cached {depth}"


def build_deep_checkpoint(out_dir: str, max_position: int = 8192) -> str:
    """The single-user checkpoint's weights (same seed) with room for ``max_position`` tokens."""
    import shutil
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA_06, "max_position_embeddings": max_position})).to(
        torch.bfloat16).save_pretrained(out_dir)
    demo = Path(__file__).resolve().parent.parent / "demo_model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out_dir)
    return out_dir


def _time(llm, prompt: list[int], new: int) -> float:
    from engine import SamplingParams
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def measure_ours(model: str, threads: int, quantization, depth: int, follow: int, new: int,
                 repeats: int) -> dict:
    from engine import LLM
    torch.set_num_threads(threads)
    llm = LLM(model, dtype="bfloat16", num_threads=threads, quantization=quantization,
              max_model_len=depth + follow + new + 16, max_num_batched_tokens=2048, enable_prefix_caching=True)
    vocab = llm.model_config.vocab_size
    prefix = prompts(1, depth, vocab, 5)[0]
    _time(llm, prefix, 1)  # the prefix computed and cached, untimed
    best = {}
    decode_row, follow_row = rows(depth, follow)
    for r in range(repeats):
        one = _time(llm, prefix, 1)
        rate = new / max(_time(llm, prefix, new + 1) - one, 1e-9)
        best[decode_row] = max(best.get(decode_row, 0.0), rate)
        extra = prompts(1, follow, vocab, 100 + r)[0]  # fresh tokens each repeat: never cached
        best[follow_row] = max(best.get(follow_row, 0.0), follow / _time(llm, prefix + extra, 1))
    del llm
    gc.collect()  # one engine's pool at a time: a run builds one per format and thread count
    return best


def measure_llamacpp(bin_dir: str, gguf: str, threads: int, depth: int, follow: int, new: int,
                     repeats: int) -> dict:
    out = subprocess.run([str(Path(bin_dir) / "llama-bench"), "-m", gguf, "-d", str(depth), "-p", str(follow),
                          "-n", str(new), "-t", str(threads), "-r", str(repeats), "-o", "json"],
                         capture_output=True, text=True, check=True)
    decode_row, follow_row = rows(depth, follow)
    return {follow_row if test["n_prompt"] else decode_row: test["avg_ts"] for test in json.loads(out.stdout)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.depth", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a bfloat16 checkpoint with room for the depth (default: built)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--depth", type=int, default=4096)
    p.add_argument("--follow", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--formats", default="bf16,int8,int4,q8_0")
    p.add_argument("--llamacpp-bin", help="llama.cpp's build/bin (llama-bench)")
    p.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE.gguf",
                   help="the same checkpoint as GGUF, e.g. 'llama.cpp Q4_0=q4_0.gguf'")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    systems = [f"ours {f}" for f in args.formats.split(",")]
    rates = {}
    with tempfile.TemporaryDirectory(prefix="depth_") as tmp:
        model = args.model or build_deep_checkpoint(tmp)
        for t in threads:
            for system in systems:
                for row, rate in measure_ours(model, t, FORMATS[system], args.depth, args.follow, args.new,
                                              args.repeats).items():
                    rates[(system, row, t)] = rate
            for item in args.gguf if args.llamacpp_bin else []:
                name, path = item.split("=", 1)
                for row, rate in measure_llamacpp(args.llamacpp_bin, path, t, args.depth, args.follow, args.new,
                                                  args.repeats).items():
                    rates[(name, row, t)] = rate
    names = [s for s in dict.fromkeys(key[0] for key in rates)]
    print(cpu_line())
    print("| row | threads | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    for row in rows(args.depth, args.follow):
        for t in threads:
            print(f"| {row} | {t} | " + " | ".join(f"{rates.get((n, row, t), float('nan')):.1f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
