"""Exercise 3: a preempted request comes back. What does its re-admission cost in hashes?

Two requests, each with a prompt of 200 random tokens (block_size 16: 12 full blocks and 8
tokens more), decode 64 tokens each in a pool of only 30 blocks. Both fit at admission (13
blocks each). As they decode, their blocks fill: a block completed during decode is hashed
and cached too, so each sequence's chain grows. Once the pool is full, the next token that
needs a new block makes the scheduler preempt the most recently admitted sequence. Its blocks are freed (the cached ones stay reusable), and it goes back to the
front of the queue as the same ``Sequence`` object, chain included.

From then on, admission looks it up once per step until there is room for it again; it
is looked up {lookups} times before it runs again.

Predict:

1. how many full blocks the preempted sequence's tokens fill when it is preempted
   (how long a chain a lookup of it has to cover);
2. the hash calls of those {lookups} lookups under ``hash_strategy="recompute"``;
3. the hash calls of those {lookups} lookups under ``"incremental"``.

The exercise counts through the prefix cache's event log (``llm.prefix_cache.recording()``): the
hashes made at a lookup, and a lookup each time block 0 is probed.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import LLM, SamplingParams
from exercises.common import DEMO_MODEL, GREEDY, random_prompt
from prefix_cache import HashSource

TITLE = "A preempted request comes back"
LOOKUPS = 24  # stated in the question; tests/test_exercises.py checks the engine agrees
__doc__ = __doc__.format(lookups=LOOKUPS)
ASKS = ("full blocks when preempted", "recompute: hash calls", "incremental: hash calls")
HINT = ("A lookup under recompute rebuilds the chain over all the sequence's full blocks, "
        "prompt and decoded tokens alike. Under incremental, where does the chain live while "
        "the sequence waits?")
AT_LOOKUP = (HashSource.PRECOMPUTED, HashSource.RECOMPUTED)


@dataclass
class Readmission:
    strategy: str
    preemptions: int
    full_blocks: int   # of the preempted sequence when it was preempted
    lookups: int       # of the preempted sequence, from its preemption until it ran again
    hash_calls: int    # made by those lookups

    def line(self) -> str:
        return (f"{self.strategy:11s}: {self.preemptions} preemption; the preempted request ({self.full_blocks} "
                f"full blocks) was looked up {self.lookups} times before it ran again: {self.hash_calls} hash calls")


def measure_one(model: str, strategy: str) -> Readmission:
    llm = LLM(model, block_size=16, num_kv_blocks=30, max_num_batched_tokens=512,
              hash_strategy=strategy, device="cpu", dtype="float32", enforce_eager=True)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=64, **GREEDY)
    for seed in (1, 2):
        llm.add_request(random_prompt(200, seed=seed, vocab=vocab), params)
    victim, start, full_blocks = None, 0, 0
    with llm.prefix_cache.recording() as events:  # every hash, reuse, hit, miss, wait, save
        while llm.has_unfinished_requests():
            mark = len(events)
            llm.step()
            if victim is None and llm.stats()["preemptions"]:
                victim, start = llm.scheduler.waiting[0], mark  # preempted in this step's schedule
                full_blocks = victim.num_tokens // llm.block_size
    after = [e for e in events[start:] if e.request_id == victim.request_id]
    lookups = sum(e.kind in ("hit", "miss") and e.index == 0 for e in after)
    calls = sum(e.kind == "hash" and e.source in AT_LOOKUP for e in after)
    return Readmission(strategy, llm.stats()["preemptions"], full_blocks, lookups, calls)


def measure(model: str = str(DEMO_MODEL)) -> list[Readmission]:
    return [measure_one(model, s) for s in ("recompute", "incremental")]


def answer(result: list[Readmission]) -> list[str]:
    recompute, incremental = result
    return [str(recompute.full_blocks), str(recompute.hash_calls), str(incremental.hash_calls)]


def report(result: list[Readmission]) -> list[str]:
    return [r.line() for r in result]


if __name__ == "__main__":
    print("\n".join(report(measure())))
