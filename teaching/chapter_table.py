"""The chapter's table, counted live: each row's hash calls and the time spent in them.

Used by ``python run.py`` (which prints it), by the exercises and by the tests, so a row
means the same everywhere: its label and definition live here, once. The counts are the
engine's own ``hash_computations``; the time is measured around each call of the cache's
``hash_fn`` (xxhash of one block's bytes), so it is the hashing itself, not the lookup or the
save around it. Which calls were made at save is read from the cache's recorded events. Nothing of
the engine is replaced: ``hash_fn`` is the cache's swappable hash, wrapped with a clock.
"""
from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass
from typing import Callable

from engine import LLM, SamplingParams, Sequence
from prefix_cache import HashSource, PrefixCache

STRATEGIES = ("recompute", "incremental")
# The chapter's own names for the two columns: the "before" is the Paged Prefix Cache.
COLUMN_NAMES = {"recompute": "Paged Prefix Cache (recompute)", "incremental": "step14_5 (incremental)"}
AT_SAVE = {HashSource.RECOMPUTED_AT_SAVE, HashSource.DECODE, HashSource.SAVE}  # hash calls made while saving
REPEATS = 2  # the µs and ms printed are the minimum over this many runs (counts never vary)


@dataclass
class HashCost:
    calls: int
    us: float  # microseconds spent inside the hash calls


class HashMeter:
    """Times every call of ``prefix_cache.hash_fn`` (the cache's swappable hash function).

    The count is the engine's own ``hash_computations``. While ``events`` is a recording
    (``PrefixCache.recording``), each call is also noted with the index of the event it
    produced (the "hash" event that ``_chain_hash``'s caller records next), so time can be
    split by where it was spent.
    """

    def __init__(self, prefix_cache: PrefixCache) -> None:
        self.prefix_cache = prefix_cache
        self.ns = 0
        self.events: list | None = None
        self.noted: list[tuple[int, int]] = []  # (event index, ns) per call while recording
        prefix_cache.hash_fn = self._timed(prefix_cache.hash_fn)

    def _timed(self, hash_fn):
        def timed(data: bytes, seed: int) -> int:
            start = time.perf_counter_ns()
            try:
                return hash_fn(data, seed)
            finally:
                ns = time.perf_counter_ns() - start
                self.ns += ns
                if self.events is not None:
                    self.noted.append((len(self.events), ns))
        return timed

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
    # enforce_eager: a teaching run never waits for the fast layer's compiler (fast/kernels.py).
    return LLM(model, **(dict(enforce_eager=True) | engine_kw | dict(max_num_batched_tokens=budget) | kw))


def chapter_rows(model: str, engine_kw: dict, prompt: list[int], strategy: str,
                 repeats: int = REPEATS) -> dict[str, HashCost]:
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
    pc.lookup(seq)
    again = meter.measure(lambda: pc.lookup(seq))
    new_seq = meter.measure(send(prompt))
    llm.reset_prefix_cache()
    twice = meter.measure(send(prompt, prompt))
    return dict(zip((r.label for r in ROWS), (cold, at_save, again, new_seq, twice)))


def cost_with_saves(meter: HashMeter, pc: PrefixCache, fn) -> tuple[HashCost, HashCost]:
    """The hash calls ``fn()`` makes in all, and the part made while saving blocks (the
    "hash" events whose source is a save: recomputed at save, computed at decode or at save)."""
    with pc.recording() as events:
        meter.events, meter.noted = events, []
        try:
            total = meter.measure(fn)
        finally:
            meter.events = None
    at_save = [e.kind == "hash" and e.source in AT_SAVE for e in events]
    us = sum(ns for index, ns in meter.noted if index < len(events) and at_save[index]) / 1000
    meter.noted = []
    return total, HashCost(sum(at_save), us)


def prefill_ms(model: str, engine_kw: dict, prompt: list[int], repeats: int = REPEATS) -> float:
    """One cold prefill of ``prompt`` (cache off, one forward): min over ``repeats``, in ms."""
    llm = chapter_llm(model, engine_kw, prompt, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def us_per_hash_call(hash_fn, block_size: int, calls: int = 20000) -> float:
    """One hash call on one block's bytes, in µs: the median of 5 batches of ``calls`` calls.
    Timing each row's few dozen calls instead measures the clock and the machine's noise
    (rows came out inverted); calls x this cost does not."""
    data = bytes(8 * block_size)
    batches = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for seed in range(calls):
            hash_fn(data, seed)
        batches.append((time.perf_counter_ns() - start) / calls / 1000)
    return sorted(batches)[2]


def print_chapter_table(rows: dict, prompt_len: int, block_size: int, prefill: float,
                        per_call_us: float) -> None:
    print(f"\nThe chapter's table, counted live: prompt of {prompt_len} tokens, block_size "
          f"{block_size}, N = {prompt_len // block_size} full blocks")
    names = [COLUMN_NAMES[s] for s in STRATEGIES]
    print(f"  {'hash calls':32s} {names[0]:>31s} {names[1]:>23s}")
    for row in ROWS:
        r, i = rows["recompute"][row.label], rows["incremental"][row.label]
        print(f"  {row.label:32s} {r.calls:>31d} {i.calls:>23d}")
    print("  Each row counts:")
    for row in ROWS:
        print(textwrap.fill(f"{row.label.strip()}: {row.definition}", 100, initial_indent="    ",
                            subsequent_indent="      "))
    print(f"  The rule behind every row:\n    {RULE[0]};\n    {RULE[1]}.")
    calls = max(rows["recompute"][r.label].calls - rows["incremental"][r.label].calls for r in ROWS)
    gap = calls * per_call_us
    print(f"  For scale: one hash call takes {per_call_us:.2f} µs (median over 20,000 calls), so the "
          f"largest difference\n  in any row, {calls} calls, is {gap:.0f} µs; one cold prefill of "
          f"this prompt (cache off, one forward)\n  takes {prefill:.0f} ms (min of {REPEATS} runs).")
