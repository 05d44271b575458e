"""``python run.py --plot DIR``: the figures the README shows, written as PNG files.

* ``hash_cost_vs_prompt_length.png``: hash calls and the time spent in them for prompts of
  256 to 8192 tokens, both strategies, a cold request (lookup + saves) and a re-lookup of the
  same Sequence. Measured on the engine's own scheduler and prefix cache with the model
  forward left out: hashing never reads K/V, so the counts are exactly the engine's, and the
  sweep to 8192 tokens runs on any checkpoint (the demo model's context is 1024).
* ``prompt_tokens_per_round.png``: prompt tokens computed vs served from cache, per engine and
  round of the demo run.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from block_manager import BlockManager  # noqa: E402
from teaching.chapter_table import HashCost, HashMeter  # noqa: E402
from prefix_cache import PrefixCache  # noqa: E402
from api.sampling_params import SamplingParams  # noqa: E402
from scheduler import Scheduler, SchedulerConfig, Sequence  # noqa: E402

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
CASES = ("cold", "re-lookup")
COLORS = {"recompute": "tab:red", "incremental": "tab:blue"}


def prefill_without_model(scheduler: Scheduler, seq: Sequence) -> None:
    """Admit ``seq`` and commit its prefill chunk by chunk, as the engine's step does minus the
    forward: the lookup, the in-flight marks and every save run exactly as in ``LLM.step``."""
    scheduler.add(seq)
    while seq.num_computed_tokens < seq.num_tokens:
        scheduler.commit(scheduler.schedule())
    scheduler.finish(seq, "length")


def hash_cost(strategy: str, length: int, block_size: int, seed: int = 0) -> dict[str, HashCost]:
    """A cold request of ``length`` tokens, then the same Sequence looked up again."""
    blocks = BlockManager(length // block_size + 2, block_size)
    cache = PrefixCache(blocks, strategy)
    meter = HashMeter(cache)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048), blocks, cache)
    tokens = np.random.default_rng(seed).integers(0, 32000, length)
    seq = Sequence(tokens, SamplingParams(max_tokens=1))
    cold = meter.measure(lambda: prefill_without_model(scheduler, seq))
    again = meter.measure(lambda: cache._lookup_prefix_cache(seq))
    return {"cold": cold, "re-lookup": again}


def hash_sweep(block_size: int = 16, lengths=LENGTHS, repeats: int = 5) -> dict:
    """(strategy, case) -> [HashCost per length]; µs: the minimum over ``repeats``."""
    sweep = {}
    for strategy in COLORS:
        for length in lengths:
            runs = [hash_cost(strategy, length, block_size) for _ in range(repeats)]
            for case in CASES:
                best = min((r[case] for r in runs), key=lambda c: c.us)
                sweep.setdefault((strategy, case), []).append(best)
    return sweep


def plot_hash_cost(sweep: dict, lengths, block_size: int, path: Path) -> None:
    fig, (calls_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (strategy, case), costs in sweep.items():
        style = dict(color=COLORS[strategy], linestyle="-" if case == "cold" else "--", marker="o")
        calls_ax.plot(lengths, [c.calls for c in costs], label=f"{strategy}, {case}", **style)
        time_ax.plot(lengths, [c.us for c in costs], label=f"{strategy}, {case}", **style)
    for ax, ylabel in ((calls_ax, "xxhash calls"), (time_ax, "µs spent in them (min of 5)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    calls_ax.legend()
    fig.suptitle(f"Hashing cost per request, block_size {block_size}: cold = lookup + saves, "
                 f"re-lookup = the same Sequence again")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prompt_tokens(results: dict, path: Path) -> None:
    """Stacked bars: prompt tokens computed (dark) and served from cache (light), per round."""
    labels, computed, cached = [], [], []
    for mode, rounds in results.items():
        for n, r in enumerate(rounds, 1):
            labels.append(f"{mode}\nround {n}")
            computed.append(r.stats["prompt_tokens_computed"])
            cached.append(r.stats["prompt_tokens_cached"])
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(labels))
    ax.bar(x, computed, color="tab:gray", label="computed (prefill)")
    ax.bar(x, cached, bottom=computed, color="tab:green", alpha=0.6, label="served from cache")
    for i, (c, h) in enumerate(zip(computed, cached)):
        ax.text(i, c + h, f"{c} + {h}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_ylim(0, 1.15 * max(c + h for c, h in zip(computed, cached)))  # room for the labels
    ax.set_ylabel("prompt tokens")
    ax.set_title("Prompt tokens computed vs served from cache, per engine and round")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(directory: Path, results: dict, block_size: int, lengths=LENGTHS) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "hash_cost_vs_prompt_length.png", directory / "prompt_tokens_per_round.png"]
    sweep = hash_sweep(block_size, lengths)
    plot_hash_cost(sweep, lengths, block_size, paths[0])
    plot_prompt_tokens(results, paths[1])
    print_sweep(sweep, lengths)
    print("Wrote " + ", ".join(str(p) for p in paths))
    return paths


def print_sweep(sweep: dict, lengths) -> None:
    """The first figure's numbers: hash calls (µs in them) per prompt length."""
    print("\nHashing per request (the first figure): calls (µs in them, min of 5)")
    print(f"  {'prompt tokens':24s}" + "".join(f"{n:>14d}" for n in lengths))
    for (strategy, case), costs in sweep.items():
        cells = "".join(f"{c.calls:>7d} ({c.us:>4.0f})" for c in costs)
        print(f"  {strategy + ', ' + case:24s}{cells}")
