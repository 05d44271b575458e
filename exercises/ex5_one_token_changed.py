"""Exercise 5: change one token and predict which blocks still hit.

Send the demo prompt (527 tokens), then the same prompt with the token at position 300
replaced. At ``block_size`` 16, 32 and 64: which blocks of the second request are served
from cache, how many tokens is that, and how many of its full blocks get a new hash?
(Position 300 lies in block 300 // block_size; a block's hash is seeded with its parent's.)

Check: ``python -m exercises.ex5_one_token_changed``, and see it block by block with
``python run.py --chain --change-at 300``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import LLM
from exercises.common import DEMO_MODEL, demo_prompt, send

POSITION = 300


@dataclass
class ChangedOutcome:
    block_size: int
    cached_tokens: int        # of the changed prompt, served from cache
    changed_hashes: int       # full blocks whose hash differs from the original's
    full_blocks: int

    def line(self) -> str:
        return (f"block_size {self.block_size:>2d}: {self.cached_tokens} tokens from cache "
                f"({self.cached_tokens // self.block_size} blocks); {self.changed_hashes} of "
                f"{self.full_blocks} full blocks get a new hash")


def measure_one(model: str, block_size: int, position: int = POSITION) -> ChangedOutcome:
    llm = LLM(model, block_size=block_size, device="cpu", dtype="float32", max_num_seqs=2)
    prompt = demo_prompt(0)
    changed = list(prompt)
    changed[position] = (prompt[position] + 1) % llm.model_config.vocab_size
    (original,) = send(llm, [prompt])
    before = llm.stats()["prompt_tokens_cached"]
    (edited,) = send(llm, [changed])
    differ = sum(a != b for a, b in zip(original._block_hashes, edited._block_hashes))
    return ChangedOutcome(block_size, llm.stats()["prompt_tokens_cached"] - before, differ,
                          len(edited._block_hashes))


def measure(model: str = str(DEMO_MODEL)) -> list[ChangedOutcome]:
    return [measure_one(model, bs) for bs in (16, 32, 64)]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for outcome in measure():
        print(outcome.line())
