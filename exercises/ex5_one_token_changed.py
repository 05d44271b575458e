"""Exercise 5: change one token. Which blocks still hit?

Send the demo prompt (527 tokens); then send the same prompt with the token at position 300
replaced by another one. A block's hash is seeded with its parent's hash, so one hash names
the whole prefix up to its block. Position 300 lies in block 300 // block_size.

Predict, for the second request:

1. block_size 16: tokens served from cache;
2. block_size 16: full blocks whose hash differs from the first request's;
3. block_size 32: tokens served from cache;
4. block_size 32: full blocks with a new hash;
5. block_size 64: tokens served from cache;
6. block_size 64: full blocks with a new hash.

See it block by block afterwards with ``python run.py --chain --change-at 300``.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import LLM
from exercises.common import DEMO_MODEL, demo_prompt, send

TITLE = "One token changed"
POSITION = 300
ASKS = ("16: tokens from cache", "16: new hashes", "32: tokens from cache", "32: new hashes",
        "64: tokens from cache", "64: new hashes")
HINT = ("Cached tokens come in whole blocks, and only blocks before the changed one can hit. "
        "The prompt has 527 // block_size full blocks.")


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
    llm = LLM(model, block_size=block_size, device="cpu", dtype="float32", max_num_seqs=2,
              num_kv_blocks=4 * 528 // block_size, enforce_eager=True)
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


def answer(result: list[ChangedOutcome]) -> list[str]:
    return [str(v) for o in result for v in (o.cached_tokens, o.changed_hashes)]


def report(result: list[ChangedOutcome]) -> list[str]:
    return [o.line() for o in result]


if __name__ == "__main__":
    print("\n".join(report(measure())))
