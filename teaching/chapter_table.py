"""The chapter's table, counted live: each row's hash calls and the time spent in them.

Used by ``python run.py`` (which prints it), by the exercises and by the tests, so a row
means the same everywhere: its label and definition live here, once. The counts are the
engine's own ``hash_computations``; the time is measured around each call of
``PrefixCache._chain_hash`` (slicing the block's bytes + xxhash), so it is the hashing
itself, not the lookup or the save around it.
"""
from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass
from typing import Callable

from engine import LLM, SamplingParams, Sequence
from prefix_cache import PrefixCache

STRATEGIES = ("recompute", "incremental")


@dataclass
class HashCost:
    calls: int
    us: float  # microseconds spent inside the hash calls


class HashMeter:
    """Wraps ``prefix_cache._chain_hash`` on this one instance; nothing else changes."""

    def __init__(self, prefix_cache: PrefixCache) -> None:
        self.prefix_cache = prefix_cache
        self.ns = 0
        original = prefix_cache._chain_hash

        def timed(*args):
            start = time.perf_counter_ns()
            try:
                return original(*args)
            finally:
                self.ns += time.perf_counter_ns() - start
        prefix_cache._chain_hash = timed

    def total(self) -> HashCost:
        return HashCost(self.prefix_cache.hash_computations, self.ns / 1000)

    def measure(self, fn: Callable[[], object]) -> HashCost:
        """The hash calls ``fn()`` makes, and the time spent in them."""
        before = self.total()
        fn()
        after = self.total()
        return HashCost(after.calls - before.calls, after.us - before.us)


@dataclass(frozen=True)
class Row:
    label: str
    definition: str


# One definition per row: run.py prints these, the README quotes them, the tests import them.
ROWS = (
    Row("cold request", "a prompt the cache has never seen, sent alone: its lookup + the saves "
        "of the blocks its prefill computes"),
    Row("  of which at save", "the part of the cold request's calls made while saving its "
        "blocks (inside _do_prefill_step)"),
    Row("same Sequence looked up again", "a second lookup of the same Sequence object, as on a "
        "retry or a re-admission after preemption"),
    Row("same prompt, new Sequence", "the prompt sent again as a new request after the first "
        "finished: its lookup + its saves"),
    Row("two copies in one step", "the prompt sent twice at once, cache empty: the second copy "
        "waits one step for the blocks the first is computing (the in-flight rule), is looked up "
        "again and hits; both requests' lookups + saves"),
)
RULE = ("recompute hashes every full block at every lookup, plus each newly computed full block at save",
        "incremental hashes each full block once per Sequence")


def chapter_llm(model: str, engine_kw: dict, prompt: list[int], **kw) -> LLM:
    """An engine for the table: a step budget that fits two copies of the prompt (the wait row)."""
    budget = max(engine_kw.get("max_num_batched_tokens") or 0, 2 * len(prompt))
    return LLM(model, **(engine_kw | dict(max_num_batched_tokens=budget) | kw))


def chapter_rows(model: str, engine_kw: dict, prompt: list[int], strategy: str,
                 repeats: int = 3) -> dict[str, HashCost]:
    """The chapter's table for one strategy, counted by the engine; µs: min over ``repeats``."""
    llm = chapter_llm(model, engine_kw, prompt, hash_strategy=strategy)
    meter, best = HashMeter(llm.prefix_cache), {}
    for _ in range(repeats):
        for label, cost in measure_rows(llm, meter, prompt).items():
            if label in best and best[label].calls != cost.calls:
                raise RuntimeError(f"row {label!r}: {cost.calls} hash calls, before {best[label].calls}")
            if label not in best or cost.us < best[label].us:
                best[label] = cost
    return best


def measure_rows(llm: LLM, meter: HashMeter, prompt: list[int]) -> dict[str, HashCost]:
    """Every row of ``ROWS`` once, each on an empty cache where the row says so."""
    pc = llm.prefix_cache
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def send(*prompts):  # the requests, sent together, as a callable for the meter
        return lambda: llm.generate(list(prompts), params, use_tqdm=False)
    llm.reset_prefix_cache()
    cold, at_save = cost_with_saves(meter, pc, send(prompt))
    seq = Sequence(prompt)
    pc._lookup_prefix_cache(seq)
    again = meter.measure(lambda: pc._lookup_prefix_cache(seq))
    new_seq = meter.measure(send(prompt))
    llm.reset_prefix_cache()
    twice = meter.measure(send(prompt, prompt))
    return dict(zip((r.label for r in ROWS), (cold, at_save, again, new_seq, twice)))


def cost_with_saves(meter: HashMeter, pc, fn) -> tuple[HashCost, HashCost]:
    """The hash calls ``fn()`` makes in all, and the part made inside ``_do_prefill_step``."""
    saves, real = HashCost(0, 0.0), pc._do_prefill_step

    def counted(*args):
        nonlocal saves
        result = []
        cost = meter.measure(lambda: result.append(real(*args)))
        saves = HashCost(saves.calls + cost.calls, saves.us + cost.us)
        return result[0]
    pc._do_prefill_step = counted
    try:
        total = meter.measure(fn)
    finally:
        del pc._do_prefill_step  # the class's method again
    return total, saves


def prefill_ms(model: str, engine_kw: dict, prompt: list[int], repeats: int = 3) -> float:
    """One cold prefill of ``prompt`` (cache off, one forward): min over ``repeats``, in ms."""
    llm = chapter_llm(model, engine_kw, prompt, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def print_chapter_table(rows: dict, prompt_len: int, block_size: int, prefill: float) -> None:
    print(f"\nThe chapter's table, counted live: prompt of {prompt_len} tokens, block_size "
          f"{block_size}, N = {prompt_len // block_size} full blocks")
    print(f"  {'hash calls (µs spent in them)':32s} {'step14 (recompute)':>20s} {'step14_5 (incremental)':>24s}")
    for row in ROWS:
        r, i = rows["recompute"][row.label], rows["incremental"][row.label]
        print(f"  {row.label:32s} {r.calls:>8d} ({r.us:>6.0f} µs) {i.calls:>12d} ({i.us:>6.0f} µs)")
    print("  Each row counts:")
    for row in ROWS:
        print(textwrap.fill(f"{row.label.strip()}: {row.definition}", 100, initial_indent="    ",
                            subsequent_indent="      "))
    print(f"  The rule behind every row:\n    {RULE[0]};\n    {RULE[1]}.")
    gap = max(rows["recompute"][r.label].us - rows["incremental"][r.label].us for r in ROWS)
    print(f"  For scale: one cold prefill of this prompt (cache off, one forward) takes {prefill:.0f} ms; "
          f"the largest hashing\n  difference between the strategies in any row is {gap:.0f} µs "
          f"({gap / (10 * prefill):.3f} % of it). µs: min of 3 runs.")
