"""step14_5 demo: the incremental hash chain of the paged prefix cache, measured live.

A shared-prefix workload runs in two rounds (round 2 repeats round 1 and adds follow-up
turns that extend round 1's conversations) on three engines: prefix cache off,
``hash_strategy="recompute"`` (the chapter's "before", step14) and ``"incremental"``
(step14_5). It prints the chapter's table from the engines' own counters, cache and
throughput figures per round, and checks that every run produced identical tokens.

    python run.py                      # the shipped demo model (demo_model/)
    python run.py --model DIR          # any local Llama / Qwen2 / Qwen3 / Mistral checkpoint
    python run.py --show-blocks 1      # draw the KV pool after step 1 of round 2
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
from tqdm.auto import tqdm

from engine import LLM, SamplingParams, Sequence

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "demo_model"
MODES = {"cache off": dict(enable_prefix_caching=False),
         "recompute": dict(hash_strategy="recompute"),
         "incremental": dict(hash_strategy="incremental")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="local Hugging Face checkpoint directory")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV budget in bytes (instead of --num-kv-blocks)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=16, help="max running sequences")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--num-requests", type=int, default=8, help="requests per round")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-blocks", type=int, nargs="?", const=1, default=None, metavar="STEP",
                   help="draw the KV pool after this step of round 2 (incremental engine)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p.parse_args(argv)


def engine_args(args) -> dict:
    return dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                dtype=args.dtype, seed=args.seed)


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


def chapter_rows(model: str, args, prompt: list[int], strategy: str) -> dict[str, int]:
    """The chapter's table for one strategy, each row counted by the engine itself."""
    llm = LLM(model, hash_strategy=strategy, **engine_args(args))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    saving = count_hashes_inside(llm, llm.prefix_cache, "_do_prefill_step")
    cold = count_hashes(llm, lambda: llm.generate([prompt], params, use_tqdm=False))
    saving_cold = saving["calls"]
    seq = Sequence(prompt)
    llm.prefix_cache._lookup_prefix_cache(seq)
    again = count_hashes(llm, lambda: llm.prefix_cache._lookup_prefix_cache(seq))
    repeated = count_hashes(llm, lambda: llm.generate([prompt], params, use_tqdm=False))
    return {"cold request (lookup + save)": cold, "saving during prefill (cold)": saving_cold,
            "same Sequence looked up again": again, "repeated prompt, new Sequence": repeated}


def count_hashes(llm: LLM, fn) -> int:
    before = llm.stats()["hash_computations"]
    fn()
    return llm.stats()["hash_computations"] - before


def count_hashes_inside(llm: LLM, owner, method: str) -> dict:
    """Wrap one method so the hash calls made inside it are counted in ``["calls"]``."""
    original, counted = getattr(owner, method), {"calls": 0}

    def wrapped(*a, **kw):
        result = None

        def call():
            nonlocal result
            result = original(*a, **kw)
        counted["calls"] += count_hashes(llm, call)
        return result
    setattr(owner, method, wrapped)
    return counted


# ----------------------------------------------------------------------------- printing

def print_chapter_table(rows: dict, num_blocks: int, block_size: int, prompt_len: int) -> None:
    print(f"\nThe chapter's table, counted live (prompt of {prompt_len} tokens, block_size "
          f"{block_size}, N = {num_blocks} full blocks)")
    print(f"  {'xxhash calls':36s} {'step14 (recompute)':>20s} {'step14_5 (incremental)':>24s}")
    for row in rows["recompute"]:
        print(f"  {row:36s} {rows['recompute'][row]:>20d} {rows['incremental'][row]:>24d}")
    print("  (the chapter's 0 for a repeated prompt holds for the same Sequence object; a new\n"
          "   request is a new Sequence and hashes its blocks once - then every block but the\n"
          "   last is served from cache)")


def print_rounds(results: dict) -> None:
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


def print_samples(llm: LLM, prompts, token_ids, count: int = 3) -> None:
    if llm.tokenizer is None:
        return
    print("\nSample continuations (prompt tail ... | greedy continuation):")
    for prompt, out in list(zip(prompts, token_ids))[:count]:
        tail = llm.tokenizer.decode(prompt[-24:]).replace("\n", " ")
        text = llm.tokenizer.decode(out).replace("\n", " ")
        print(f"  ...{tail} | {text}")


def show_blocks(llm: LLM, title: str) -> None:
    """The KV pool as a learner wants to see it: block tables, sharing, cached-free, evicted."""
    bm = llm.block_manager
    owners: dict[int, list[str]] = {}
    print(f"\n=== KV pool {title}: {bm.num_blocks} blocks of {llm.block_size} tokens ===")
    for seq in llm.scheduler.running:
        for b in seq.block_table:
            owners.setdefault(b, []).append(seq.request_id)
        print(f"  seq {seq.request_id:>3s}: {seq.num_computed_tokens:>4d}/{seq.num_tokens:<4d} tokens computed, "
              f"blocks {_ranges(seq.block_table)}")
    shared = {b: o for b, o in owners.items() if len(o) > 1}
    by_owners: dict[tuple, list[int]] = {}
    for block_id, seqs in shared.items():
        by_owners.setdefault(tuple(seqs), []).append(block_id)
    print(f"  shared blocks: {len(shared)}" + "".join(
        f"\n    blocks {_ranges(sorted(ids))} shared by seqs {', '.join(seqs)}"
        for seqs, ids in by_owners.items()))
    cells = ["S" if b.block_id in shared else "U" if b.ref_count else "c" if b.block_hash is not None
             else "." for b in bm.blocks]
    print("  map (S shared, U in use by one, c cached-and-free, . free):")
    last = max((i for i, c in enumerate(cells) if c != "."), default=0)
    for i in range(0, last + 1, 64):
        print(f"    {i:>5d} {''.join(cells[i:i + 64])}")
    if last + 64 < len(cells):
        print(f"    ... blocks {(last // 64 + 1) * 64}-{len(cells) - 1} are all free")
    print(f"  cached-and-free: {cells.count('c')}, free: {cells.count('.')}, "
          f"evicted so far: {llm.stats()['evictions']}, waiting requests: {len(llm.scheduler.waiting)}")


def _ranges(ids: list[int]) -> str:
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            parts.append(str(ids[start]) if start == i - 1 else f"{ids[start]}-{ids[i - 1]}")
            start = i
    return "[" + " ".join(parts) + "]"


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results, tokens = {}, {}
    for mode, kw in MODES.items():
        llm = LLM(str(model_dir), **engine_args(args), **kw)
        first = round1_prompts(llm, model_dir, args.num_requests, args.seed)
        llm.generate([first[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        show = (lambda l, step: step == args.show_blocks and show_blocks(l, f"after step {step} of round 2")) \
            if mode == "incremental" and args.show_blocks is not None else None
        r1 = run_round(llm, first, params, f"{mode} round 1", not args.no_progress)
        r2 = run_round(llm, round2_prompts(first, r1.token_ids), params,
                       f"{mode} round 2", not args.no_progress, on_step=show)
        results[mode], tokens[mode] = [r1, r2], (r1.token_ids, r2.token_ids)
    print(f"\nModel {model_dir} ({llm.model_config.architecture}), {llm.num_blocks} KV blocks of "
          f"{llm.block_size}, {args.num_requests} requests/round, {args.max_tokens} new tokens each, "
          f"device {llm.device}, dtype {str(llm.dtype).removeprefix('torch.')}")
    print_samples(llm, first, tokens["incremental"][0])
    longest = max(first, key=len)
    rows = {s: chapter_rows(str(model_dir), args, longest, s) for s in ("recompute", "incremental")}
    print_chapter_table(rows, len(longest) // args.block_size, args.block_size, len(longest))
    print("\nPer round (round 2 = round 1 again + follow-up turns extending round 1's answers):")
    print_rounds(results)
    return report_identical(tokens, args.num_requests)


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
