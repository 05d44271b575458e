"""8-bit weights beside bfloat16, this engine and llama.cpp (Q8_0), in one run.

    python -m benchmarks.int8_bench --model CKPT [--threads 1,2] \
        [--llamacpp-bin DIR --gguf-bf16 FILE --gguf-q8 FILE] [--quality-logits NAME=FILE.npy ...]

The rows are benchmarks/single_user.py's (prefill 512, prefill 16 x 256, decode batch 16,
decode batch 1), for this engine in bfloat16 and with ``quantization="int8"``, and, when given,
llama.cpp on the same checkpoint converted to GGUF in bf16 and quantized to Q8_0
(``llama-quantize``). Each thread count gets the batch-1 streaming bound of both weight
formats. Then the quality standard (benchmarks/int8_quality.py) on the checkpoint, with any
llama.cpp logits of the same token ids (``python -m benchmarks.int8_quality --ids-out``).
"""
from __future__ import annotations

import argparse

from benchmarks import int8_quality
from benchmarks.single_user import (Shape, build_ours, measure_llamacpp, measure_rows, read_bandwidth,
                                   streamed_bytes)

SYSTEMS = ("llama.cpp bf16", "llama.cpp Q8_0", "ours bf16", "ours int8")


def run(model: str, threads: list[int], repeats: int, bin_dir: str | None, ggufs: dict,
        shape: Shape = Shape()) -> tuple[dict, dict, list[str]]:
    """(system, row, threads) -> tok/s; (format, threads) -> batch-1 bound; descriptions. Our
    two formats take turns, one repeat each (this VM's speed drifts over minutes: side by side,
    not one after the other)."""
    rates, bounds, described = {}, {}, []
    for t in threads:
        bandwidth = read_bandwidth(t)
        ours = {system: build_ours(model, t, dict(dtype="bfloat16", quantization=quant), shape)
                for quant, system in ((None, "ours bf16"), ("int8", "ours int8"))}
        for _ in range(repeats):
            for system, llm in ours.items():
                for row, rate in measure_rows(llm, shape).items():
                    rates[(system, row, t)] = max(rates.get((system, row, t), 0.0), rate)
        for (quant, system) in ((None, "ours bf16"), ("int8", "ours int8")):
            bounds[(system, t)] = bandwidth / streamed_bytes(model, quant, itemsize=2)
            described.append(f"{system}, {t} thread(s): "
                             f"{ours[system].llm_engine.engine_core.model_runner.backend.describe()}")
        del ours
        for system, gguf in ggufs.items():
            if bin_dir and gguf:
                got = measure_llamacpp(bin_dir, gguf, t, repeats)
                rates.update({(system, row, t): rate for row, rate in got.items()})
    return rates, bounds, described


def report(rates: dict, bounds: dict, threads: list[int], shape: Shape = Shape()) -> list[str]:
    systems = [s for s in SYSTEMS if any(key[0] == s for key in rates)]
    lines = ["| metric | threads | " + " | ".join(systems) + " | int8 / bf16 | int8 / Q8_0 |",
             "|---|---|" + "---:|" * (len(systems) + 2)]
    for row in shape.rows:
        for t in threads:
            cells = [f"{rates[(s, row, t)]:.1f}" for s in systems]
            ours, base = rates[("ours int8", row, t)], rates[("ours bf16", row, t)]
            q8 = rates.get(("llama.cpp Q8_0", row, t))
            ratios = [_ratio(ours, base), _ratio(ours, q8)]
            lines.append(f"| {row} | {t} | " + " | ".join(cells + ratios) + " |")
    for t in threads:
        lines.append(f"\nBatch-1 decode bound at {t} thread(s) (weights over the measured read bandwidth): "
                     f"bf16 {bounds[('ours bf16', t)]:.1f} tok/s, int8 {bounds[('ours int8', t)]:.1f} tok/s.")
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
    p.add_argument("--quality-logits", action="append", default=[], metavar="NAME=FILE.npy",
                   help="llama.cpp's logits of int8_quality's token ids for this checkpoint")
    p.add_argument("--no-quality", action="store_true")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    ggufs = {"llama.cpp bf16": args.gguf_bf16, "llama.cpp Q8_0": args.gguf_q8}
    rates, bounds, described = run(args.model, threads, args.repeats, args.llamacpp_bin, ggufs)
    print("\n".join(report(rates, bounds, threads)))
    print("\n" + "\n".join(described))
    if not args.no_quality:
        print("\n".join(quality(args.model, dict(item.split("=", 1) for item in args.quality_logits))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
