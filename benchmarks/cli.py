"""The benchmark's command line (``python bench.py`` or ``python -m benchmarks``): this engine side by side with Hugging Face transformers and vLLM's CPU build.

Every system runs the same random Qwen3 checkpoint (built on the fly) on the same greedy,
EOS-ignoring workloads, one system at a time, each warmed up first:

* ours:                  ``engine.LLM(...).generate`` (paged KV, continuous batching, prefix cache)
* HF ``generate_batch``: transformers' continuous batching, prefix sharing on (``--peers hf``)
* HF ``generate``:       padded ``model.generate``, one batch (``--peers hf``)
* vLLM-CPU:              ``vllm.LLM`` in its own venv, in a subprocess (``--vllm-python PATH``)

Sizes: ``--model-sizes 42m,0.6b`` (the bench's own 42M Qwen3 and Qwen3-0.6B's shape; an item
``0.6b:bfloat16`` runs that size in that dtype only) times ``--dtypes float32,bfloat16``;
``--scale quarter`` runs a quarter of the requests. Ours runs twice: with its fast paths and as
"ours (plain)" (``fast_paths=False``), so the table shows what the fast paths buy.

Workloads: (a) no sharing (random prompts of mixed length), (b) one long shared prefix with
distinct suffixes, (c) the prefix-cache hash chain alone. Each thread configuration
(``--threads default,1``) runs (a) and (b) for ours and every peer; ``--busy-neighbour`` runs
ours again, right after its quiet run, beside one CPU-bound process. Ends with one table (ours ÷ each peer), tokens
compared request by request, and the project's targets. The parts live in ``benchmarks/``.

    python bench.py --quick                                   # reduced sizes, HF peers
    python bench.py --vllm-python /opt/vllm-venv/bin/python   # full scale, with vLLM
    python bench.py --peers vllm --threads 1 --no-busy-neighbour --json out.json
    python bench.py --model-sizes 42m:float32,0.6b:bfloat16 --scale quarter --profile \
        --markdown docs/benchmarks_results.md                 # the figures in the docs
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from benchmarks import hashing, ours_profile
from benchmarks.machine_load import measure_load
from benchmarks.ours import BUSY_SYSTEM, PLAIN_SYSTEM, run_ours, warmup_ours
from benchmarks.peer_hf_generate import run_hf_generate, warmup_hf_generate
from benchmarks.peer_hf_generate_batch import (run_hf_generate_batch,
                                               warmup_hf_generate_batch)
from benchmarks.peer_vllm import VllmPeer
from benchmarks.report import Findings, Section, agreements, print_report, report_lines
from benchmarks.result import RunResult
from benchmarks.targets import check_targets, targets_for
from benchmarks.threads import (DEFAULT, INITIAL_THREADS, busy_neighbour, parse_thread_configs,
                                torch_threads)
from benchmarks.workloads import (MODEL_SHAPES, SCALES, Sizes, Workload, build_checkpoint,
                                  model_facts, random_tokens, torch_dtype, workload_no_sharing,
                                  workload_shared_prefix)

HF_BATCH, HF_PADDED = "hf-batch", "hf-padded"
PEERS = (HF_BATCH, HF_PADDED, "vllm")  # "hf" names both HF modes
DTYPES = ("float32", "bfloat16")
IN_PROGRESS = "(run still in progress)"  # the markdown's last line while sections remain


def parse_args(argv=None, shapes: dict | None = None) -> argparse.Namespace:
    """``shapes`` replaces the named model shapes (the smoke test passes tiny stand-ins)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: a random Qwen3 built on the fly)")
    p.add_argument("--dtypes", "--dtype", default="float32",
                   help=f"comma-separated from {','.join(DTYPES)} (default float32)")
    p.add_argument("--model-sizes", default=None,
                   help="comma-separated model shapes, random weights built on the fly: "
                        f"{', '.join(MODEL_SHAPES)}; NAME:DTYPE runs that size in that dtype "
                        "only (default: the preset's model, 42m, or 8m with --quick)")
    p.add_argument("--scale", default="full", choices=list(SCALES),
                   help="full, or quarter: a quarter of the requests (default full)")
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                   help="also run ours with fast_paths=False, as 'ours (plain)'")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="reduced sizes and model")
    p.add_argument("--threads", default=f"{DEFAULT},1",
                   help="thread configurations to run, comma-separated: 'default' (each system's "
                        "own default) and/or a count N (N torch threads; vLLM bound to N cores)")
    p.add_argument("--peers", default=None,
                   help="comma-separated from hf (both HF modes), hf-batch, hf-padded, vllm, "
                        "or 'none' (default: hf, plus vllm when --vllm-python is given)")
    p.add_argument("--hf-threads", default=None,
                   help="the thread configurations the HF peers run under (default: every one "
                        "in --threads); e.g. 'default' to keep a 0.6B run short")
    p.add_argument("--vllm-python", help="interpreter of a venv with vLLM's CPU build")
    p.add_argument("--busy-neighbour", action=argparse.BooleanOptionalAction, default=True,
                   help="also run ours beside one CPU-bound process (default thread policy)")
    p.add_argument("--hashing", action=argparse.BooleanOptionalAction, default=True,
                   help="(c) the hash chain alone")
    p.add_argument("--profile", action="store_true",
                   help="also profile by phase: prefill vs the matmul peak, a decode step vs "
                        "the weight-streaming bound, the top ops")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per system and workload; the fastest is kept (default 1)")
    p.add_argument("--hf-generate-batch-size", type=int, default=None,
                   help="batch size of padded model.generate (default: all requests at once)")
    p.add_argument("--single-user", action="store_true",
                   help="also the single-user table (benchmarks/single_user.py) on its Llama "
                        "checkpoint, beside llama.cpp when --llamacpp-bin and --gguf are given")
    p.add_argument("--single-user-model", help="that checkpoint (default: built on the fly)")
    p.add_argument("--llamacpp-bin", help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    p.add_argument("--gguf", help="the single-user checkpoint converted to GGUF by llama.cpp")
    p.add_argument("--json", help="write the results to this path")
    p.add_argument("--markdown", help="write the report as markdown to this path "
                                      "(e.g. docs/benchmarks_results.md)")
    p.add_argument("--append-markdown", action="store_true",
                   help="append this run's report to --markdown's file instead of replacing it "
                        "(runs with different thread configurations in one file)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    args.thread_configs = parse_thread_configs(args.threads)
    args.hf_thread_configs = (args.thread_configs if args.hf_threads is None
                              else parse_thread_configs(args.hf_threads))
    args.peer_set = parse_peers(args)
    args.combos = parse_combos(args, shapes or MODEL_SHAPES)
    return args


def parse_peers(args: argparse.Namespace) -> set[str]:
    if args.peers is None:
        return {HF_BATCH, HF_PADDED} | ({"vllm"} if args.vllm_python else set())
    peers = set() if args.peers == "none" else {p.strip() for p in args.peers.split(",") if p.strip()}
    if "hf" in peers:
        peers = (peers - {"hf"}) | {HF_BATCH, HF_PADDED}
    unknown = peers - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown peer(s) {sorted(unknown)}; choose from hf, "
                         f"{', '.join(PEERS)}")
    if "vllm" in peers and not args.vllm_python:
        raise SystemExit("--peers vllm needs --vllm-python PATH (the interpreter of vLLM's venv)")
    return peers


def split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_combos(args: argparse.Namespace, shapes: dict) -> list[tuple[str | None, str]]:
    """[(shape name or None for the preset's model, dtype)], in the order given."""
    dtypes = split_list(args.dtypes)
    bad = [d for d in dtypes if d not in DTYPES]
    if not dtypes or bad:
        raise SystemExit(f"--dtypes: {bad or 'none given'}; choose from {', '.join(DTYPES)}")
    if args.model_sizes is None:
        return [(None, d) for d in dtypes]
    if args.model:
        raise SystemExit("--model-sizes builds random checkpoints: it cannot go with --model")
    combos = []
    for item in split_list(args.model_sizes):
        name, _, only = item.partition(":")
        if name not in shapes:
            raise SystemExit(f"--model-sizes: unknown size {name!r}; choose from {', '.join(shapes)}")
        if only and only not in DTYPES:
            raise SystemExit(f"--model-sizes: {item!r}: unknown dtype; choose from {', '.join(DTYPES)}")
        combos += [(name, d) for d in ([only] if only else dtypes)]
    return combos


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
    """What every part of one section (one model size in one dtype) shares."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    model_dir: str
    facts: dict
    vocab: int
    workloads: list[Workload]
    dtype: str
    hashing: bool = True  # (c) runs in the first section only: it does not depend on the size


def log_run(r: RunResult) -> None:
    load = r.load or {}
    others = load.get("others_cores")
    log(f"  {r.system} [threads {r.threads}, {r.compute_threads} compute]: {r.wall_s:.1f} s, "
        f"{r.out_tps:.1f} out tok/s" + (f", {r.extra}" if r.extra else "")
        + (f"; others' cores {others:.1f}" if others is not None else ""))
    log(f"    settings: {r.settings}")


def with_load(run) -> RunResult:
    """One run, with the machine's load meanwhile noted on its result."""
    with measure_load() as load:
        r = run()
    r.load = load
    return r


def best_of(repeats: int, run) -> RunResult:
    """The fastest of `repeats` runs (a busy shared machine only ever adds time)."""
    return min((with_load(run) for _ in range(repeats)), key=lambda r: r.wall_s)


def in_process_runners(ctx: BenchContext, w: Workload, threads: str, with_neighbour: bool) -> list:
    """Ours (and, back to back, ours beside a busy neighbour), ours (plain), then each HF peer."""
    args, s, device, model_dir, dtype = ctx.args, ctx.sizes, ctx.device, ctx.model_dir, ctx.dtype
    runners = [lambda: run_ours(model_dir, w, s, dtype, device, threads)]
    if with_neighbour:
        runners.append(lambda: run_beside_busy_neighbour(ctx, w, threads))
    if args.plain:
        runners.append(lambda: run_ours(model_dir, w, s, dtype, device, threads, PLAIN_SYSTEM))
    hf = hf_peers(args, threads)
    if HF_BATCH in hf:
        runners.append(lambda: run_hf_generate_batch(model_dir, w, s, dtype, device, threads))
    if HF_PADDED in hf:
        runners.append(lambda: run_hf_generate(model_dir, w, dtype, device, threads,
                                               args.hf_generate_batch_size))
    return runners


def run_beside_busy_neighbour(ctx: BenchContext, w: Workload, threads: str) -> RunResult:
    """Ours again while one other CPU-bound process runs; the quiet run just before is the base."""
    with busy_neighbour():
        return run_ours(ctx.model_dir, w, ctx.sizes, ctx.dtype, ctx.device, threads,
                        system=BUSY_SYSTEM)


def hf_peers(args, threads: str) -> set[str]:
    """The HF peers that run under this thread configuration."""
    return args.peer_set & {HF_BATCH, HF_PADDED} if threads in args.hf_thread_configs else set()


def warm_up(ctx: BenchContext, threads: str) -> None:
    args, s, device, model_dir, dtype = ctx.args, ctx.sizes, ctx.device, ctx.model_dir, ctx.dtype
    warmup_ours(model_dir, s, ctx.vocab, dtype, device)
    if args.plain:
        warmup_ours(model_dir, s, ctx.vocab, dtype, device, fast_paths=False)
    hf = hf_peers(args, threads)
    if HF_PADDED in hf:
        warmup_hf_generate(model_dir, ctx.vocab, dtype, device)
    if HF_BATCH in hf:
        warmup_hf_generate_batch(model_dir, s, ctx.vocab, dtype, device)


def run_in_process(ctx: BenchContext, threads: str, with_neighbour: bool) -> list[RunResult]:
    """Ours and the HF peers on every workload, under one thread configuration."""
    rows = []
    with torch_threads(threads):
        log(f"\n== threads {threads} (torch intra-op threads {torch.get_num_threads()}): warm-up ...")
        warm_up(ctx, threads)
        for w in ctx.workloads:
            log(f"-- {w.name}: {w.description} ({w.prompt_tokens} prompt tok, {w.output_tokens} out tok)")
            for run in in_process_runners(ctx, w, threads, with_neighbour):
                with torch_threads(threads):  # each system starts from the configuration's count
                    rows.append(best_of(ctx.args.repeats, run))
                log_run(rows[-1])
    return rows


def run_vllm(ctx: BenchContext, threads: str) -> list[RunResult]:
    args = ctx.args
    log(f"\n== vLLM-CPU, threads {threads}: one process for every workload (start-up ~2 min) ...")
    peer = VllmPeer(args.vllm_python, ctx.model_dir, ctx.dtype, ctx.sizes, args.repeats)
    with measure_load() as load:
        rows = peer.run(ctx.workloads, ctx.vocab, threads)
    for r in rows:
        r.load = load  # over the whole vLLM process, its start-up included
        log_run(r)
    return rows


def run_hashing(ctx: BenchContext) -> list[dict]:
    args, s = ctx.args, ctx.sizes
    log(f"\n== (c) hashing alone: {s.hash_prompt}-token prompt, block 16, median of {s.hash_reps}")
    tokens = random_tokens(np.random.default_rng(4), s.hash_prompt, ctx.vocab)
    rows = [hashing.bench_hash_ours(ctx.model_dir, tokens, strategy, s.hash_reps, ctx.dtype,
                                    ctx.device) for strategy in ("recompute", "incremental")]
    if args.peer_set & {HF_BATCH, HF_PADDED}:
        rows.append(hashing.bench_hash_hf(ctx.model_dir, tokens, s.hash_reps))
    log("block hash algorithms (model-free, empty cache):\n"
        + hashing.algo_table(hashing.bench_hash_algos(tokens, s.hash_reps)))
    return rows


def run_profile(ctx: BenchContext, f: Findings) -> None:
    """The profile by phase, at torch's default thread count, the machine's load noted."""
    with torch_threads(DEFAULT), measure_load() as f.profile_load:
        log(f"\n== profile by phase ({ctx.dtype}, torch default threads {torch.get_num_threads()})")
        measure_profile(ctx, f)


def measure_profile(ctx: BenchContext, f: Findings) -> None:
    s, device, dtype, facts = ctx.sizes, ctx.device, ctx.dtype, ctx.facts
    f.peaks = ours_profile.matmul_peaks(s, facts, torch_dtype(dtype), device)
    f.bandwidth = ours_profile.memory_bandwidth(device)
    peak = f.peaks["peak_flop_s"]
    f.prefill = ours_profile.bench_prefill(ctx.model_dir, ctx.workloads[0], s, facts, peak,
                                           dtype, device)
    f.decode_bounds, f.decode = ours_profile.bench_decode(ctx.model_dir, s, facts, dtype, device,
                                                          f.bandwidth["bytes_s"], peak)


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
    if args.hashing and ctx.hashing:
        f.hashing = run_hashing(ctx)
    if args.profile:
        run_profile(ctx, f)
    return f


def bench_device(args) -> torch.device:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if "vllm" in args.peer_set and device.type != "cpu":
        raise SystemExit("--peers vllm compares with vLLM's CPU build: run with --device cpu")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(f"--vllm-python {args.vllm_python}: not an executable file")
    return device


def context(args, s: Sizes, model_dir: str, dtype: str, device: torch.device,
            first: bool) -> BenchContext:
    facts = model_facts(model_dir)
    vocab = facts["vocab_size"]
    return BenchContext(args, s, device, model_dir, facts, vocab,
                        [workload_no_sharing(s, vocab), workload_shared_prefix(s, vocab)],
                        dtype, hashing=first)


def shape_name(model: dict, shapes: dict) -> str:
    return next((name for name, shape in shapes.items() if shape == model), "custom")


class Checkpoints:
    """One random checkpoint per model size, built when first needed (float32 on disk: every
    dtype of that size loads the same weights)."""

    def __init__(self, root: str, given: str | None) -> None:
        self.root, self.given, self.built = root, given, {}

    def get(self, name: str, model: dict) -> str:
        if self.given:
            return self.given
        if name not in self.built:
            log(f"\nbuilding a random Qwen3 {name} checkpoint ...")
            self.built[name] = build_checkpoint(os.path.join(self.root, name), model)
        return self.built[name]


def run_section(args, base: Sizes, combo, shapes: dict, ckpts: Checkpoints,
                device: torch.device, first: bool) -> Section:
    name, dtype = combo
    s = base.with_model(shapes[name]) if name else base
    label = "given checkpoint" if args.model else (name or shape_name(s.model, shapes))
    with measure_load() as load:
        ctx = context(args, s, ckpts.get(label, s.model), dtype, device, first)
        log(f"\n#### {label}, {dtype}, {args.scale} scale: params {ctx.facts['params']:,} "
            f"({ctx.facts['params_without_embedding']:,} without embedding)")
        findings = run_all(ctx)
    verdicts = check_targets(findings, targets_for(label, dtype))
    return Section(label, dtype, args.scale, ctx.facts, findings, verdicts, load)


def main(argv=None, sizes: Sizes | None = None, shapes: dict | None = None) -> dict:
    """Run everything; ``sizes`` overrides the presets and ``shapes`` the named model shapes
    (the smoke test passes tiny ones)."""
    args = parse_args(argv, shapes)
    shapes = shapes or MODEL_SHAPES
    base = (sizes or (Sizes.quick() if args.quick else Sizes())).scaled(args.scale)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warn_if_busy()
    device = bench_device(args)
    log(header_line(args, device))
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        ckpts = Checkpoints(tmp, args.model)
        sections = []
        for i, combo in enumerate(args.combos):
            sections.append(run_section(args, base, combo, shapes, ckpts, device, i == 0))
            if args.markdown and i + 1 < len(args.combos):  # so far, in case a later one fails
                write_markdown(args.markdown, argv, device, started,
                               report_lines(sections) + ["", IN_PROGRESS],
                               args.append_markdown)
    lines = print_report(sections, log)
    if args.single_user:
        lines += single_user_lines(args)
    report = build_json(args, base, device, sections)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2, default=str)
        log(f"\nwrote {args.json}")
    if args.markdown:
        write_markdown(args.markdown, argv, device, started, lines, args.append_markdown)
        log(f"wrote {args.markdown}")
    return report


def single_user_lines(args) -> list[str]:
    """The single-user table, one or two compute threads as --threads names them."""
    from . import single_user
    threads = sorted({int(c) if c.isdigit() else os.cpu_count() or 1 for c in args.thread_configs})
    with tempfile.TemporaryDirectory(prefix="single_user_") as tmp:
        model = args.single_user_model or single_user.build_llama_06(tmp)
        table = single_user.run(model, threads, max(args.repeats, 2), args.llamacpp_bin, args.gguf)
    lines = ["", "### Single user: Qwen3-0.6B's body as a Llama, bfloat16", ""] + single_user.report(table)
    for line in lines:
        log(line)
    return lines


def header_line(args, device: torch.device) -> str:
    return (f"bench.py{' --quick' if args.quick else ''}: device={device}, torch {torch.__version__}, "
            f"default intra-op threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
            f"peers {sorted(args.peer_set) or 'none'}, sections "
            + ", ".join(f"{n or 'preset'}/{d}" for n, d in args.combos))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or "unknown"


# The CPU features the kernels are chosen by (fast/paths.py), as /proc/cpuinfo names them.
KERNEL_FEATURES = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_line() -> str:
    """The CPU's name and which of the kernels' features it has: every figure names its machine."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        flags = set()
    have = [f for f in KERNEL_FEATURES if f in flags]
    missing = [f for f in KERNEL_FEATURES if f not in flags]
    return (f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; has {' '.join(have) or 'none of'}"
            + (f"; lacks {' '.join(missing)}" if missing else ""))


def write_markdown(path: str, argv, device: torch.device, started: float, lines: list[str],
                   append: bool = False) -> None:
    """The whole report as a markdown file: how it was made, then every table. ``append``: after
    what the file holds (written by an earlier run), from the last complete run on."""
    command = "python bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    earlier = completed_markdown(path) if append else ""
    title = (["", "---", "", "# Another run"] if earlier else
             ["# Benchmark results", "",
              "Written by the bench itself (`benchmarks/cli.py`, `--markdown`); regenerate, "
              "don't edit."])
    head = title + ["",
            f"- command: `{command}`",
            f"- run: {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))} to "
            f"{time.strftime('%H:%M', time.localtime())}; device {device}; {cpu_name()}, "
            f"{os.cpu_count()} CPUs; torch {torch.__version__}, default intra-op threads "
            f"{INITIAL_THREADS}",
            "- the machine was shared: every row names the cores other processes kept busy during "
            "it (others' cores), so compare figures within a run, and read them as noisy where "
            "that column is high."]
    with open(path, "w") as out:
        out.write(earlier + "\n".join(head + lines) + "\n")


def completed_markdown(path: str) -> str:
    """What an earlier run wrote to `path`, its in-progress mark dropped ('' if none)."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read().replace(f"\n{IN_PROGRESS}\n", "\n")


def build_json(args, base: Sizes, device: torch.device, sections: list[Section]) -> dict:
    options = {k: v for k, v in vars(args).items() if k != "peer_set"}
    return dict(args=options, peers=sorted(args.peer_set), device=str(device),
                sections=[section_json(sec, base) for sec in sections])


def section_json(sec: Section, base: Sizes) -> dict:
    f = sec.findings
    agreement = [dict(workload=a.row.workload, threads=a.row.threads, system=a.row.system,
                      identical=a.identical, total=a.total, first_mismatch=a.first_mismatch)
                 for a in agreements(f)]
    runs = [dict(r.summary(), ours_over_this=f.ratio(r)) for r in f.runs]
    return dict(model_size=sec.model_size, dtype=sec.dtype, scale=sec.scale,
                sizes=dict(asdict(base), model=None), model=sec.facts, load=sec.load, runs=runs,
                agreement=agreement, hashing=f.hashing, peaks=f.peaks, bandwidth=f.bandwidth,
                prefill=f.prefill, decode=f.decode, decode_bounds=f.decode_bounds,
                profile_load=f.profile_load,
                targets=sec.verdicts)
