"""Exercise 3: force a preemption and count the hashes of the re-admission.

Two requests of 200 tokens (block_size 16: 12 full blocks each) decode 64 tokens each in a
pool of 30 blocks. Both fit at admission (13 blocks each), but their decodes outgrow the
pool, so the scheduler preempts the most recently admitted one: its blocks are freed (the
cached ones stay reusable) and it goes back to the front of the queue. Every step until
blocks are free again, admission looks it up (and finds too few free blocks).

Predict, for each strategy: how many lookups the preempted request goes through before it
runs again, and how many hash calls they cost. Which one is the chapter's "0 for the same
Sequence"? Check: ``python -m exercises.ex3_preemption``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import LLM
from exercises.common import DEMO_MODEL, random_prompt, send


@dataclass
class Readmission:
    strategy: str
    preemptions: int
    full_blocks: int   # of the preempted request when it was preempted
    lookups: int       # of the preempted request, from its preemption until it ran again
    hash_calls: int    # made by those lookups

    def line(self) -> str:
        return (f"{self.strategy:11s}: {self.preemptions} preemption; the preempted request ({self.full_blocks} "
                f"full blocks) was looked up {self.lookups} times before it ran again: {self.hash_calls} hash calls")


def measure_one(model: str, strategy: str) -> Readmission:
    llm = LLM(model, block_size=16, num_kv_blocks=30, max_num_batched_tokens=512,
              hash_strategy=strategy, device="cpu", dtype="float32")
    pc, sched = llm.prefix_cache, llm.scheduler
    lookups, preempted = [], []  # (request id, hash calls) per lookup; (request id, lookups so far, blocks)
    real_lookup, real_preempt = pc._lookup_prefix_cache, sched.preempt

    def lookup(seq):
        before = pc.hash_computations
        match = real_lookup(seq)
        lookups.append((seq.request_id, pc.hash_computations - before))
        return match

    def preempt(seq):
        preempted.append((seq.request_id, len(lookups), seq.num_tokens // llm.block_size))
        real_preempt(seq)
    pc._lookup_prefix_cache, sched.preempt = lookup, preempt
    vocab = llm.model_config.vocab_size
    send(llm, [random_prompt(200, seed=1, vocab=vocab), random_prompt(200, seed=2, vocab=vocab)], max_tokens=64)
    victim, start, full_blocks = preempted[0]
    mine = [calls for rid, calls in lookups[start:] if rid == victim]
    return Readmission(strategy, len(preempted), full_blocks, len(mine), sum(mine))


def measure(model: str = str(DEMO_MODEL)) -> list[Readmission]:
    return [measure_one(model, s) for s in ("recompute", "incremental")]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for outcome in measure():
        print(outcome.line())
