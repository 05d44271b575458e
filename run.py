"""step14_5 demo: the incremental hash chain of the paged prefix cache, measured live.

A shared-prefix workload runs in two rounds (round 2 repeats round 1 and adds follow-up
turns that extend round 1's conversations) on three engines: prefix cache off,
``hash_strategy="recompute"`` (the chapter's "before", its Paged Prefix Cache) and
``"incremental"`` (step14_5). It prints the chapter's table from the engines' own counters,
cache and throughput figures per round, and checks that every run produced identical tokens.
The two cache-on engines run twice each, in the order recompute, incremental, incremental,
recompute (the second time after ``reset_prefix_cache()``), so their timing columns do not
depend on which one runs first.

    python run.py                      # the shipped demo model (demo_model/)
    python run.py --model DIR          # any local Llama / Qwen2 / Qwen3 / Mistral checkpoint
    python run.py --chain              # one request's chain of block hashes, block by block
    python run.py --show-blocks 1      # draw the KV pool after step 1 of each round
    python run.py --plot docs          # also write the figures (PNG) into docs/
    python run.py --html steps.html    # a page that plays a small run step by step
    python run.py --html steps.html --screenshot docs/step_page.png   # and one step as PNG

The chapter's table (its rows, their definitions, the rule) is teaching/chapter_table.py; the
--chain tracer is teaching/chain_view.py; the figures are teaching/demo_plots.py; the page is
teaching/step_page.py. For one Sequence at the REPL: ``python -m teaching.poke``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from engine import LLM, SamplingParams
from teaching.pool_view import count_events, draw_pool
from teaching.chapter_table import (COLUMN_NAMES, STRATEGIES, chapter_rows, prefill_ms,
                                    print_chapter_table, us_per_hash_call)

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "demo_model"
MODES = {"cache off": dict(enable_prefix_caching=False),
         "recompute": dict(hash_strategy="recompute"),
         "incremental": dict(hash_strategy="incremental")}
# The order alternates between rounds, so neither strategy always runs first.
ROUND_ORDER = {1: ("cache off", "recompute", "incremental"), 2: ("cache off", "incremental", "recompute")}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (None means: chosen at start-up)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="local Hugging Face checkpoint directory")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from the budget)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV budget in bytes (instead of --num-kv-blocks)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=16, help="max running sequences")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--num-requests", type=int, default=8, help="requests per round")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--seed", type=int, default=0, help="sampling seed and random-prompt seed")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch CPU threads, the same in every mode (default: every core torch sees; "
                        "the engine uses fewer only if other processes keep the cores busy)")
    p.add_argument("--show-blocks", type=int, nargs="?", const=1, default=None, metavar="STEP",
                   help="draw the KV pool after this step of round 1 and of round 2 (incremental engine)")
    p.add_argument("--chain", action="store_true",
                   help="trace one request's chain of block hashes instead; its token ids: --prompt's text "
                        "through the tokenizer, else the model's prompts.json prompt 0, else seeded random ids")
    p.add_argument("--prompt", default=None, help="--chain: the prompt text (default: demo prompt 0)")
    p.add_argument("--change-at", type=int, default=None, metavar="K",
                   help="--chain: the token position to change (default: the middle of the prompt)")
    p.add_argument("--plot", default=None, metavar="DIR", help="also write the figures as PNG files into DIR")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="instead: write a self-contained page that plays a small run step by step")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="--html: also save one step of the page as PNG (needs chromium)")
    p.add_argument("--step", type=int, default=None,
                   help="--screenshot: the step to show (default: the step with the most kinds of events)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--restart", nargs="?", const="", default=None, metavar="DIR",
                   help="one restart from the disk tier: the longest prompt cold, then in a new "
                        "engine from the tier (in DIR, default a temporary directory)")
    args = p.parse_args(argv)
    if args.screenshot and not args.html:
        p.error("--screenshot draws a step of the --html page: give --html FILE too")
    return args


def engine_args(args) -> dict:
    return dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                dtype=args.dtype, seed=args.seed,
                enforce_eager=True)  # the demo never waits for a compiler (fast/kernels.py)


# ----------------------------------------------------------------------------- workload

def round1_prompts(llm: LLM, model_dir: Path, n: int, seed: int) -> list[list[int]]:
    """The demo model's corpus prompts (one long shared prefix); else a generic system prompt."""
    spec = model_dir / "prompts.json"
    if spec.is_file():
        prompts = [p["prompt_ids"] for p in json.loads(spec.read_text())["prompts"]]
        return [prompts[i % len(prompts)] for i in range(n)] if n > len(prompts) else prompts[:n]
    rng = np.random.default_rng(seed)
    vocab = llm.model_config.vocab_size
    if llm.tokenizer is not None:
        system = llm.tokenizer(SYSTEM_PROMPT)["input_ids"]
        return [system + llm.tokenizer(f"\nQuestion {i + 1}: {q}\nAnswer:")["input_ids"]
                for i, q in zip(range(n), QUESTIONS * n)]
    system = rng.integers(0, vocab, min(400, llm.max_model_len // 4)).tolist()
    return [system + rng.integers(0, vocab, 24 + 8 * i).tolist() for i in range(n)]


SYSTEM_PROMPT = ("You are a careful assistant for a tutorial about paged KV caches. " * 12).strip()
QUESTIONS = ["What is a block?", "Why chain the hashes?", "What is evicted first?",
             "Why keep hashes on the sequence?", "What does a cache hit skip?",
             "Why is the last token recomputed?", "What is preemption?", "What is a ref count?"]


def round2_prompts(first: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
    """Round 1 again, plus each conversation extended by its own answer (a follow-up turn)."""
    return first + [p + a for p, a in zip(first, answers)]


# ----------------------------------------------------------------------------- running

@dataclass
class RoundResult:
    token_ids: list[list[int]]
    wall: float
    ttft: list[float]
    stats: dict

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def run_round(llm: LLM, prompts, params, label: str, progress: bool, on_step=None) -> RoundResult:
    before = llm.stats()
    start = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    done = {}
    with tqdm(total=len(ids), desc=label, unit="req", disable=not progress, leave=False) as bar:
        while llm.has_unfinished_requests():
            for out in llm.step():
                done[out.request_id] = out
                bar.update(1)
            if on_step:
                on_step(llm, llm.stats()["steps"] - before["steps"])
    wall = time.perf_counter() - start
    outs = [done[i] for i in ids]
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    return RoundResult([o.token_ids for o in outs], wall, [o.metrics["ttft"] for o in outs], delta)


# ----------------------------------------------------------------------------- printing

def print_rounds(results: dict, per_call_us: float) -> None:
    print(f"\n  {'engine':12s} {'round':>5s} {'hit rate':>9s} {'computed':>9s} {'cached':>7s} "
          f"{'TTFT ms':>8s} {'out tok/s':>10s} {'hashes':>7s} {'evict':>6s} {'preempt':>8s}")
    for mode, rounds in results.items():
        for i, r in enumerate(rounds, 1):
            s = r.stats
            hit = s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0
            print(f"  {mode:12s} {i:>5d} {hit:>8.1%} {s['prompt_tokens_computed']:>9d} "
                  f"{s['prompt_tokens_cached']:>7d} {1000 * statistics.mean(r.ttft):>8.1f} "
                  f"{r.output_tokens / r.wall:>10.1f} {s['hash_computations']:>7d} "
                  f"{s['evictions']:>6d} {s['preemptions']:>8d}")
    print_round_notes(results, per_call_us)


def print_round_notes(results: dict, per_call_us: float) -> None:
    """What the columns mean, how the timings were taken, and what they show this run."""
    worst = per_call_us * max(r.stats["hash_computations"] for mode in STRATEGIES for r in results[mode])
    print("  TTFT: time to first token, mean over the round's requests; out tok/s: output tokens per "
          "second of wall time.\n  recompute = " + COLUMN_NAMES["recompute"] + ", the chapter's "
          "\"before\"; incremental = " + COLUMN_NAMES["incremental"] + ".")
    for n, (r, i) in enumerate(zip(results["recompute"], results["incremental"]), 1):
        print("  " + ttft_comparison(n, r, i))
    print(f"  Hashing takes at most {worst:.0f} µs per round here (hash calls x {per_call_us:.2f} µs), so a "
          f"TTFT gap between\n  the strategies larger than that comes from the machine (run order, "
          f"caches, other load), not from hashing.")
    r2 = [results[mode][1].stats["hash_computations"] for mode in STRATEGIES]
    if r2[0] == r2[1]:
        print("  Round 2's hashes are equal: each request is a new Sequence looked up once whose full "
              "prompt blocks\n  all hit, so recompute has no prompt block to hash again at save: "
              "both hash each full block once.")


def ttft_comparison(n: int, r: RoundResult, i: RoundResult) -> str:
    """One round's TTFT under both strategies, and which of the two ran first."""
    means = [1000 * statistics.mean(x.ttft) for x in (r, i)]
    first = ROUND_ORDER[n][1]
    return (f"round {n} TTFT ms: recompute {means[0]:.1f}, incremental {means[1]:.1f}, a gap of "
            f"{abs(means[0] - means[1]):.1f} ms; {first} ran first this round")


def print_samples(llm: LLM, prompts, token_ids, count: int = 3) -> None:
    if llm.tokenizer is None:
        return
    print("\nSample continuations (prompt tail ... | greedy continuation):")
    for prompt, out in list(zip(prompts, token_ids))[:count]:
        tail = llm.tokenizer.decode(prompt[-24:]).replace("\n", " ")
        text = llm.tokenizer.decode(out).replace("\n", " ")
        print(f"  ...{tail} | {text}")


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # every mode: the demo, --chain and --html alike
    print(f"torch threads: {torch.get_num_threads()} (--threads)")
    if args.chain:
        from teaching import chain_view
        return chain_view.main(args)
    if args.html:
        return page_main(args)
    model_dir = Path(args.model)
    if args.restart is not None:
        return restart_main(args, model_dir)
    demo = run_all_modes(args, model_dir)
    llm = demo.engine
    print(f"\nModel {model_dir} ({llm.model_config.architecture}), {llm.num_blocks} KV blocks of "
          f"{llm.block_size}, {args.num_requests} requests/round, {args.max_tokens} new tokens each, "
          f"device {llm.device}, dtype {str(llm.dtype).removeprefix('torch.')}, "
          f"torch threads: {torch.get_num_threads()}")
    print(shared_prefix_line(demo.first_prompts, llm.block_size))
    for pool in demo.pools:
        print(pool)
    print_samples(llm, demo.first_prompts, demo.tokens["incremental"][0])
    longest = max(demo.first_prompts, key=len)
    rows = {s: chapter_rows(str(model_dir), engine_args(args), longest, s) for s in STRATEGIES}
    per_call = us_per_hash_call(demo.engine.prefix_cache.hash_fn, args.block_size)
    print_chapter_table(rows, len(longest), args.block_size,
                        prefill_ms(str(model_dir), engine_args(args), longest), per_call)
    print("\nPer round (round 2 = round 1 again + follow-up turns extending round 1's answers):")
    print_rounds(demo.results, per_call)
    if args.plot:
        from teaching import demo_plots
        demo_plots.write_all(Path(args.plot), rows, len(longest), str(model_dir), engine_args(args))
    return report_identical(demo.tokens, args.num_requests)


def restart_main(args, model_dir: Path) -> int:
    """``--restart``: the disk tier across one restart (teaching/disk_restart.py)."""
    from teaching import disk_restart
    probe = LLM(str(model_dir), **engine_args(args))
    prompt = max(round1_prompts(probe, model_dir, args.num_requests, args.seed), key=len)
    del probe
    return disk_restart.show(str(model_dir), engine_args(args), prompt, args.max_tokens,
                             args.restart or None)


def shared_prefix_line(prompts: list[list[int]], block_size: int) -> str:
    """How many leading token ids all round-1 prompts share (what the cache can serve them all)."""
    shared = 0
    while all(len(p) > shared and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    return (f"The {len(prompts)} round-1 prompts share their first {shared} token ids "
            f"({shared // block_size} full blocks of {block_size}), then differ.")


def page_main(args) -> int:
    """``--html FILE`` (and ``--screenshot PNG``): the step-through page of a small run."""
    from teaching import step_page
    path = Path(args.html)
    data = step_page.write_page(path, args.model, dict(device=args.device, dtype=args.dtype, seed=args.seed))
    last = data["steps"][-1]
    pool = step_page.PAGE_ENGINE
    print(f"Wrote {path}: {len(data['steps'])} engine steps, {len(data['scenes'])} scenes, a pool of "
          f"{pool['num_kv_blocks']} blocks of {pool['block_size']} tokens.\n  Hash calls over the run: "
          + ", ".join(f"{COLUMN_NAMES[s]} {last[s]['counters']['hash_computations']}" for s in STRATEGIES)
          + f".\n  Open {path.resolve().as_uri()}#step=1 (any N in #step=N; add &view=recompute "
          "for the recompute engine's pool and chains) in a browser.")
    if args.screenshot:
        step = args.step or step_page.busiest_step(data)
        step_page.screenshot(path, Path(args.screenshot), step)
        print(f"Wrote {args.screenshot}: step {step} of the page")
    return 0


@dataclass
class DemoRun:
    results: dict[str, list[RoundResult]]  # engine -> [round 1, round 2]
    tokens: dict[str, tuple]               # engine -> (round 1 tokens, round 2 tokens)
    pools: list[str]                       # the --show-blocks drawings, printed after the header
    engine: LLM                            # the incremental engine, after both rounds
    first_prompts: list[list[int]]


def run_all_modes(args, model_dir: Path) -> DemoRun:
    """Both rounds on each engine, the engines in ``ROUND_ORDER`` (recompute first in round 1,
    incremental first in round 2). The incremental engine draws the pool (``--show-blocks``)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {mode: warm_engine(args, model_dir, mode) for mode in MODES}
    demo = DemoRun({mode: [] for mode in MODES}, {}, [], engines["incremental"], [])
    # The incremental engine's events by kind, for the pool drawings (they count twin foldings).
    counts = count_events(demo.engine) if args.show_blocks is not None else None
    demo.first_prompts = round1_prompts(demo.engine, model_dir, args.num_requests, args.seed)
    for n, order in ROUND_ORDER.items():
        for mode in order:
            llm = engines[mode]
            answers = demo.results[mode][0].token_ids if n == 2 else None
            prompts = demo.first_prompts if n == 1 else round2_prompts(demo.first_prompts, answers)
            show = (pool_drawer(demo.pools, args.show_blocks, n, counts) if mode == "incremental" else None)
            demo.results[mode].append(run_round(llm, prompts, params, f"{mode} round {n}",
                                                not args.no_progress, on_step=show))
    demo.tokens = {mode: tuple(r.token_ids for r in rounds) for mode, rounds in demo.results.items()}
    return demo


def warm_engine(args, model_dir: Path, mode: str) -> LLM:
    """A fresh engine for ``mode`` after one tiny warm-up request."""
    llm = LLM(str(model_dir), **engine_args(args), **MODES[mode])
    warm_up = round1_prompts(llm, model_dir, 1, args.seed)[0][:8]
    llm.generate([warm_up], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    return llm


def pool_drawer(pools: list, step: int | None, round_no: int, counts):
    """Draw the pool into ``pools`` after ``step`` of this round (None: never)."""
    if step is None:
        return None
    note = " (request ids are per engine; 0 was its warm-up)" if round_no == 1 else ""
    return lambda llm, n: n == step and pools.append(
        draw_pool(llm, f"after step {n} of round {round_no}{note}", counts))


def report_identical(tokens: dict, n: int) -> int:
    runs = list(tokens.values())
    same_modes = all(r == runs[0] for r in runs)
    same_rounds = all(r2[:n] == r1 for r1, r2 in runs)
    ok = same_modes and same_rounds
    print(f"\nIdentical tokens: cache off = recompute = incremental: {same_modes}; "
          f"round 2 repeats = round 1: {same_rounds} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
