"""The weight formats side by side, this engine and llama.cpp, in one run: bfloat16, 8-bit
(``int8``: a scale per row; ``q8_0``: llama.cpp's Q8_0 blocks) and 4-bit (``int4``: Q4_0's).

    python -m benchmarks.int8_bench --model CKPT [--threads 1,2] [--formats bf16,int8,int4,q8_0] \
        [--llamacpp-bin DIR --gguf-bf16 FILE --gguf-q8 FILE --gguf-q4 FILE] [--quality-logits NAME=FILE.npy ...]

The rows are benchmarks/single_user.py's (prefill 512, prefill 16 x 256, decode batch 16,
decode batch 1), for this engine in each format, and, when given, llama.cpp on the same
checkpoint converted to GGUF in bf16 and quantized (``llama-quantize``, ``--pure`` for Q4_0 so
that every matrix is Q4_0). First the machine: the CPU's name and kernel features, the read
bandwidth and each format's batch-1 streaming bound per thread count. Then the quality standard
(benchmarks/int8_quality.py) on the checkpoint, with any llama.cpp logits of the same token ids
(``python -m benchmarks.int8_quality --ids-out``).
"""
from __future__ import annotations

import argparse

from benchmarks import int8_quality
from benchmarks.cli import cpu_line
from benchmarks.single_user import (Shape, build_ours, measure_llamacpp, measure_rows, read_bandwidth,
                                   streamed_bytes)

# this engine's system name -> its ``quantization`` (None: the checkpoint's bfloat16)
OURS = {"ours bf16": None, "ours int8": "int8", "ours int4": "int4", "ours q8_0": "q8_0"}
LLAMA_CPP = ("llama.cpp bf16", "llama.cpp Q8_0", "llama.cpp Q4_0")
SYSTEMS = LLAMA_CPP + tuple(OURS)
# the ratios the report gives where both systems ran: (numerator, denominator)
RATIOS = (("ours int8", "ours bf16"), ("ours bf16", "llama.cpp bf16"), ("ours int8", "llama.cpp Q8_0"),
          ("ours q8_0", "llama.cpp Q8_0"), ("ours int4", "llama.cpp Q4_0"), ("ours int4", "ours int8"))


def run(model: str, threads: list[int], repeats: int, bin_dir: str | None, ggufs: dict,
        shape: Shape = Shape(), formats: tuple = ("ours bf16", "ours int8")) -> tuple[dict, dict, list[str]]:
    """(system, row, threads) -> tok/s; (system, threads) -> batch-1 bound; descriptions (the
    machine first). Our formats take turns, one repeat each (this VM's speed drifts over
    minutes: side by side, not one after the other)."""
    rates, bounds, described = {}, {}, [cpu_line()]
    for t in threads:
        bandwidth = read_bandwidth(t)
        described.append(f"read bandwidth at {t} thread(s): {bandwidth / 1e9:.1f} GB/s (a float32 sum over 1 GiB)")
        ours = {system: build_ours(model, t, dict(dtype="bfloat16", quantization=OURS[system]), shape)
                for system in formats}
        for _ in range(repeats):
            for system, llm in ours.items():
                for row, rate in measure_rows(llm, shape).items():
                    rates[(system, row, t)] = max(rates.get((system, row, t), 0.0), rate)
        for system, llm in ours.items():
            bounds[(system, t)] = bandwidth / streamed_bytes(model, OURS[system], itemsize=2)
            described.append(f"{system}, {t} thread(s): {llm.llm_engine.engine_core.model_runner.backend.describe()}")
        del ours
        for system, gguf in ggufs.items():
            if bin_dir and gguf:
                got = measure_llamacpp(bin_dir, gguf, t, repeats)
                rates.update({(system, row, t): rate for row, rate in got.items()})
    return rates, bounds, described


def report(rates: dict, bounds: dict, threads: list[int], shape: Shape = Shape()) -> list[str]:
    systems = [s for s in SYSTEMS if any(key[0] == s for key in rates)]
    ratios = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    names = [f"{a.removeprefix('ours ')} / {b.removeprefix('ours ')}" for a, b in ratios]
    lines = ["| metric | threads | " + " | ".join(systems + names) + " |",
             "|---|---|" + "---:|" * (len(systems) + len(ratios))]
    for row in shape.rows:
        for t in threads:
            cells = [f"{rates[(s, row, t)]:.1f}" for s in systems]
            cells += [_ratio(rates[(a, row, t)], rates.get((b, row, t))) for a, b in ratios]
            lines.append(f"| {row} | {t} | " + " | ".join(cells) + " |")
    for t in threads:
        held = ", ".join(f"{s.removeprefix('ours ')} {bounds[(s, t)]:.1f}" for s in OURS if (s, t) in bounds)
        lines.append(f"\nBatch-1 decode bound at {t} thread(s) (weights over the measured read bandwidth), "
                     f"tok/s: {held}.")
    return lines


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if theirs and theirs > 0 else "-"


def quality(model: str, logits: dict[str, str]) -> list[str]:
    lines = [f"\n| quality on {model} | mean abs logprob error | max | greedy agreement "
             f"({int8_quality.POSITIONS} tokens) |", "|---|---:|---:|---:|"]
    for name, r in int8_quality.rows(model, logits):
        lines.append(f"| {name} | {r['mean']:.4f} | {r['max']:.4f} | {r['agreement']:.1%} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a local bfloat16 checkpoint directory")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llamacpp-bin", help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    p.add_argument("--gguf-bf16", help="the checkpoint converted by convert_hf_to_gguf.py --outtype bf16")
    p.add_argument("--gguf-q8", help="that GGUF quantized by llama-quantize ... Q8_0")
    p.add_argument("--gguf-q4", help="that GGUF quantized by llama-quantize --pure ... Q4_0")
    p.add_argument("--formats", default="bf16,int8,int4,q8_0", help="this engine's formats to run")
    p.add_argument("--quality-logits", action="append", default=[], metavar="NAME=FILE.npy",
                   help="llama.cpp's logits of int8_quality's token ids for this checkpoint")
    p.add_argument("--no-quality", action="store_true")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    ggufs = {"llama.cpp bf16": args.gguf_bf16, "llama.cpp Q8_0": args.gguf_q8, "llama.cpp Q4_0": args.gguf_q4}
    formats = tuple(f"ours {f}" for f in args.formats.split(","))
    rates, bounds, described = run(args.model, threads, args.repeats, args.llamacpp_bin, ggufs, formats=formats)
    print(described[0])
    print("\n".join(report(rates, bounds, threads)))
    print("\n" + "\n".join(described[1:]))
    if not args.no_quality:
        print("\n".join(quality(args.model, dict(item.split("=", 1) for item in args.quality_logits))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
