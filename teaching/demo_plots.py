"""``python run.py --plot DIR``: the figures the README shows, written as PNG files, each
saying one thing.

* ``hash_cost_vs_prompt_length.png``: hashing grows linearly with the prompt, and recompute
  pays it twice cold and again at every re-lookup. Calls and µs for prompts of 256 to 8192
  tokens on log-2 axes (a straight line of slope 1 is linear growth). Measured on the
  engine's own scheduler and prefix cache with the model forward left out: hashing never
  reads K/V, so the counts are exactly the engine's, and the sweep runs on any checkpoint.
* ``hash_calls_per_scenario.png``: the chapter's table as bars, recompute beside incremental.
* ``cumulative_hash_calls.png``: hash calls accumulating over the step page's run, which has
  an in-flight wait, retries of a preempted request and evictions.
* ``chain_diagram.png``: one request's chain as boxes (token range, short hash, parent ->
  child arrows) and, per strategy, where each block is hashed or only read: at the cold
  lookup (the precompute), at save (the reuse), and at a second lookup of the same Sequence.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from block_manager import BlockManager  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from prefix_cache import HashSource, PrefixCache  # noqa: E402
from scheduler import Scheduler, SchedulerConfig, Sequence  # noqa: E402
from teaching import step_page  # noqa: E402
from teaching.model_free import prefill_without_model  # noqa: E402
from teaching.chapter_table import COLUMN_NAMES, ROWS, STRATEGIES, HashCost, HashMeter  # noqa: E402

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
CASES = ("cold", "re-lookup")
COLORS = {"recompute": "tab:red", "incremental": "tab:blue"}
# Every line its own look: color by strategy, dash by case, marker by both.
LINE_STYLES = {("recompute", "cold"): dict(linestyle="-", marker="s", markersize=7),
               ("recompute", "re-lookup"): dict(linestyle="--", marker="D", markersize=5),
               ("incremental", "cold"): dict(linestyle="-", marker="o", markersize=11, fillstyle="none",
                                             markeredgewidth=1.8),
               ("incremental", "re-lookup"): dict(linestyle=":", marker="^", markersize=6)}
AT_LOOKUP = {HashSource.PRECOMPUTED, HashSource.RECOMPUTED}
DPI = 110


# ----------------------------------------------------------------------------- 1. the sweep

def hash_cost(strategy: str, length: int, block_size: int, seed: int = 0) -> dict[str, HashCost]:
    """A cold request of ``length`` tokens, then the same Sequence looked up again."""
    blocks = BlockManager(length // block_size + 2, block_size)
    cache = PrefixCache(blocks, strategy)
    meter = HashMeter(cache)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048), blocks, cache)
    tokens = np.random.default_rng(seed).integers(0, 32000, length)
    seq = Sequence(tokens, max_tokens=1)
    cold = meter.measure(lambda: prefill_without_model(scheduler, seq))
    again = meter.measure(lambda: cache.lookup(seq))
    return {"cold": cold, "re-lookup": again}


def hash_sweep(block_size: int = 16, lengths=LENGTHS, repeats: int = 5) -> dict:
    """(strategy, case) -> [HashCost per length]; µs: the minimum over ``repeats``."""
    sweep = {}
    for strategy in STRATEGIES:
        for length in lengths:
            runs = [hash_cost(strategy, length, block_size) for _ in range(repeats)]
            for case in CASES:
                best = min((r[case] for r in runs), key=lambda c: c.us)
                sweep.setdefault((strategy, case), []).append(best)
    return sweep


def plot_hash_cost(sweep: dict, lengths, block_size: int, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    zero = []
    for (strategy, case), costs in sweep.items():
        label = f"{strategy}, {case}"
        if all(c.calls == 0 for c in costs):
            zero.append(label)  # nothing to draw on a log axis
            continue
        style = dict(color=COLORS[strategy], label=label, **LINE_STYLES[strategy, case])
        axes[0].plot(lengths, [c.calls for c in costs], **style)
        axes[1].plot(lengths, [c.us for c in costs], **style)
    for ax, ylabel in zip(axes, ("xxhash calls per request", "µs spent in them (min of 5 runs)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("prompt length (tokens; each tick doubles it)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    n = lengths[0] // block_size  # the arrow points at this point: N calls at the shortest prompt
    axes[0].annotate(f"recompute re-lookup = incremental cold\n= N calls (N = {n} at {lengths[0]} tokens)",
                     (lengths[0], n), xytext=(lengths[1], n / 2), fontsize=8,
                     arrowprops=dict(arrowstyle="->", color="gray"))
    axes[0].set_ylim(bottom=n / 4)  # room for the note under the lines
    handles, labels = axes[0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], linestyle="none")] * len(zero)
    labels += [f"{label}: 0 calls, 0 µs at every length" for label in zero]
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"Hashing grows linearly with the prompt (slope 1 on log-log axes); block_size {block_size}.\n"
                 f"cold = lookup + saves of a new request; re-lookup = the same Sequence looked up again")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# ----------------------------------------------------------------------------- 2. per scenario

def plot_scenarios(rows: dict, prompt_len: int, block_size: int, path: Path) -> None:
    """The chapter's table as grouped bars; the cold bar split into lookup and save."""
    scenarios = [r.label for r in ROWS if not r.label.startswith(" ")]
    at_save = ROWS[1].label
    fig, ax = plt.subplots(figsize=(10, 4.6))
    x, width = np.arange(len(scenarios)), 0.38
    for k, strategy in enumerate(STRATEGIES):
        calls = [rows[strategy][s].calls for s in scenarios]
        saves = [rows[strategy][at_save].calls if s == scenarios[0] else 0 for s in scenarios]
        pos = x + (k - 0.5) * width
        ax.bar(pos, np.subtract(calls, saves), width, color=COLORS[strategy], label=COLUMN_NAMES[strategy])
        ax.bar(pos, saves, width, bottom=np.subtract(calls, saves), color=COLORS[strategy], alpha=0.45,
               hatch="//", edgecolor="white", label=f"{strategy}: of which at save" if saves[0] else None)
        for p, c in zip(pos, calls):
            ax.text(p, c, str(c), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [s.replace(", ", ",\n").replace(" looked", "\nlooked").replace(" in one", "\nin one")
                      for s in scenarios])
    ax.set_ylabel("xxhash calls")
    ax.set_ylim(0, 1.15 * max(rows["recompute"][s].calls for s in scenarios))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    ax.set_title(f"Hash calls per scenario: prompt of {prompt_len} tokens, N = {prompt_len // block_size} "
                 f"full blocks of {block_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# ----------------------------------------------------------------------------- 3. over a run

def plot_cumulative(data: dict, path: Path) -> None:
    """Cumulative hash calls per engine step of the step page's run; scenes as bands."""
    steps = data["steps"]
    x = np.arange(1, len(steps) + 1)
    fig, ax = plt.subplots(figsize=(11, 4.6))
    for strategy in STRATEGIES:
        y = [s[strategy]["counters"]["hash_computations"] for s in steps]
        ax.step(x, y, where="post", color=COLORS[strategy], marker=".", label=COLUMN_NAMES[strategy])
    scene_bands(ax, steps, data["scenes"])
    marks = {"wait": ("in-flight wait (looked up again next step)", "tab:orange", "v"),
             "preempt": ("preempted request looked up again", "tab:purple", "x")}
    for kind, (label, color, marker) in marks.items():
        at = [n for n, s in enumerate(steps, 1) if kind_of_step(s["incremental"]) == kind]
        if at:
            ys = [steps[n - 1]["recompute"]["counters"]["hash_computations"] for n in at]
            ax.scatter(at, ys, color=color, marker=marker, s=60, zorder=3, label=label)
    ax.set_xlabel("engine step")
    ax.set_ylabel("hash calls so far")
    ax.set_xlim(0.5, len(steps) + 0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    ax.set_title(f"Cumulative hash calls over one run: same workload, pool of {data['engine']['num_kv_blocks']} "
                 f"blocks of {data['engine']['block_size']} tokens", pad=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def kind_of_step(snap: dict) -> str | None:
    """'wait' if a request waited for a block in flight this step; 'preempt' if a request
    sits preempted in the queue after being looked up again (a retry); else None."""
    if any(e["kind"] == "wait" for e in snap["events"]):
        return "wait"
    waiting = {s["id"] for s in snap["seqs"] if s["status"] == "waiting" and s["computed"] == 0
               and s["tokens"] > s["prompt"]}
    if waiting and any(e["req"] in waiting for e in snap["events"]):
        return "preempt"
    return None


def scene_bands(ax, steps: list, scenes: dict) -> None:
    """Shade each scene's steps, number it inside the top of the axes, name them all below."""
    start, names = 1, []
    for n in range(1, len(steps) + 1):
        scene = steps[n - 1]["incremental"]["scene"]
        if n == len(steps) or steps[n]["incremental"]["scene"] != scene:
            ax.axvspan(start - 0.5, n + 0.5, color="gray", alpha=0.18 if len(names) % 2 else 0.07, lw=0)
            number, name = scenes[scene]["name"].split(". ", 1)
            ax.text((start + n) / 2, 0.97, number, transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=10, fontweight="bold", color="dimgray")
            names.append(f"{number} {name}")
            start = n + 1
    ax.text(0, -0.2, "scenes: " + ", ".join(names), transform=ax.transAxes, fontsize=9, va="top")


# ----------------------------------------------------------------------------- 4. the chain

def chain_trace(model: str, engine_kw: dict, strategy: str, blocks: int = 4, block_size: int = 16) -> dict:
    """One request of ``blocks`` full prompt blocks + half a block, decoding until one more
    block fills; then the same Sequence looked up again. The chain events of each phase."""
    llm = LLM(model, **(engine_kw | dict(block_size=block_size, hash_strategy=strategy, max_num_seqs=1)))
    prompt = step_page.workload_tokens(llm, model).tolist()[:blocks * block_size + block_size // 2]
    with llm.prefix_cache.recording() as cold:
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=block_size, ignore_eos=True))
        llm.step()
        seq = llm.scheduler.running[0]  # held to look it up again once it finished
        while llm.has_unfinished_requests():
            llm.step()
    with llm.prefix_cache.recording() as again:
        llm.prefix_cache.lookup(seq)  # a retry, or a re-admission after preemption
    hashes = {e.index: e.block_hash for e in cold if e.kind == "save"}
    return dict(cold=cold, again=again, prompt=len(prompt), block_size=block_size,
                hashes=hashes, total=len(prompt) + block_size)


def phase_marks(events: list, phase: str, n: int) -> list[str]:
    """Per block: 'hash' (an xxhash call), 'read' (the hash was read, no call) or '' (untouched)."""
    marks = [""] * n
    for e in events:
        if e.index is None or e.index >= n:
            continue
        if e.kind in ("hash", "reuse"):  # "reuse": the hash was read off the Sequence, no call
            at_lookup = e.source in AT_LOOKUP
            if (phase == "save") != at_lookup:
                marks[e.index] = "hash" if e.kind == "hash" else "read"
        elif e.kind in ("hit", "miss") and phase != "save" and not marks[e.index]:
            marks[e.index] = "read"
    return marks


def plot_chain(traces: dict, path: Path) -> None:
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 3.4 * len(traces)))
    for ax, (strategy, trace) in zip(axes, traces.items()):
        draw_chain(ax, strategy, trace)
    fig.suptitle("One request's chain, and where each strategy hashes a block (red) or only reads its hash (green)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


PHASE_LABELS = {"recompute": ("cold lookup: builds the chain", "save: hashes each block again",
                               "same Sequence, lookup again:\nbuilds the chain again"),
                "incremental": ("cold lookup: the precompute", "save: the reuse (a block filled\nin decode: hashed once)",
                                "same Sequence, lookup again:\nreads the chain it keeps")}


def draw_chain(ax, strategy: str, trace: dict) -> None:
    bs, n = trace["block_size"], len(trace["hashes"])
    phases = [(label, phase, trace[source]) for label, (phase, source) in
              zip(PHASE_LABELS[strategy], (("lookup", "cold"), ("save", "cold"), ("lookup", "again")))]
    ax.set_xlim(-3.4, n * 2.2 + 0.4)
    ax.set_ylim(-len(phases) - 0.6, 1.7)
    ax.axis("off")
    ax.set_title(COLUMN_NAMES[strategy], loc="left", fontsize=10, color=COLORS[strategy], fontweight="bold")
    for i in range(n):
        last = (i + 1) * bs - 1
        generated = last >= trace["prompt"]
        ax.add_patch(FancyBboxPatch((i * 2.2, 0.2), 1.7, 1.3, boxstyle="round,pad=0.03",
                                    fc="#fff6ea" if generated else "#f3f7fe",
                                    ec="#a25a00" if generated else "#4a78c2"))
        ax.text(i * 2.2 + 0.85, 0.85, f"block {i}\ntokens {i * bs}-{last}\n{step_page.short(trace['hashes'][i])}"
                + ("\n(holds generated)" if generated else ""), ha="center", va="center", fontsize=7.5,
                family="monospace")
        if i:
            ax.add_patch(FancyArrowPatch((i * 2.2 - 0.5, 0.85), (i * 2.2, 0.85), arrowstyle="->",
                                         mutation_scale=12, color="#4a78c2"))
    ax.text(-0.25, 1.6, "parent -> child: each hash seeds the next", fontsize=7.5, color="#4a78c2")
    for row, (label, phase, events) in enumerate(phases, 1):
        marks = phase_marks(events, phase, n)
        ax.text(-3.35, -row + 0.5, label, fontsize=8.5, va="center")
        for i, mark in enumerate(marks):
            color = {"hash": "tab:red", "read": "tab:green"}.get(mark, "gray")
            unfilled = row == 1 and (i + 1) * bs > trace["prompt"]  # filled later, in decode
            ax.text(i * 2.2 + 0.85, -row + 0.5, mark or ("(not full yet)" if unfilled else "-"), ha="center", va="center",
                    fontsize=9 if mark else 7.5, color=color, fontweight="bold" if mark == "hash" else "normal")
        calls = marks.count("hash")
        ax.text(n * 2.2 - 0.2, -row + 0.5, f"{calls} call{'s' * (calls != 1)}", fontsize=8.5, va="center")


# ----------------------------------------------------------------------------- all of them

def write_all(directory: Path, rows: dict, prompt_len: int, model: str, engine_kw: dict,
              lengths=LENGTHS) -> list[Path]:
    """Every figure into ``directory``; ``rows``: the chapter's table as run.py counted it for
    a prompt of ``prompt_len`` tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    names = ("hash_cost_vs_prompt_length", "hash_calls_per_scenario", "cumulative_hash_calls", "chain_diagram")
    paths = [directory / f"{name}.png" for name in names]
    block_size = engine_kw.get("block_size") or 16
    sweep = hash_sweep(block_size, lengths)
    plot_hash_cost(sweep, lengths, block_size, paths[0])
    plot_scenarios(rows, prompt_len, block_size, paths[1])
    page_kw = {k: engine_kw[k] for k in ("device", "dtype", "seed") if engine_kw.get(k) is not None}
    plot_cumulative(step_page.record(model, page_kw), paths[2])
    plot_chain({s: chain_trace(model, page_kw, s) for s in STRATEGIES}, paths[3])
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
