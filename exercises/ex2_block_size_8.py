"""Exercise 2: predict the chapter's table at another block size.

``python run.py`` prints the chapter's table for the 527-token demo prompt at block_size 16,
and under it the rule behind every row:

    recompute hashes every full block at every lookup, plus each newly computed full block
    at save; incremental hashes each full block once per Sequence.

Use the rule to predict two cells it did not print.

(a) The same prompt at block_size 8 (N = 527 // 8 = 65 full blocks). The row "cold
    request": a prompt the cache has never seen, sent alone; its lookup + the saves of the
    blocks its prefill computes.
(b) The prompt's first 512 tokens at block_size 16 (a block multiple: N = 32). First the
    cold request; once it has finished, the same prompt again as a new request. The row
    "same prompt, new Sequence": the new request's lookup + its saves.

Predict:

1. (a) recompute's hash calls;
2. (a) incremental's hash calls;
3. (b) recompute's hash calls;
4. (b) incremental's hash calls.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import LLM
from exercises.common import DEMO_MODEL, demo_prompt, send

TITLE = "The table at another block size"
ASKS = ("(a) recompute", "(a) incremental", "(b) recompute", "(b) incremental")
HINT = ("In (b) every block of the new request is cached, but the block holding the last token "
        "is never served from cache: its logits are needed to sample. What happens when that "
        "block is computed again and saved?")
STRATEGIES = ("recompute", "incremental")


@dataclass
class Cells:
    block_size: int
    prompt_len: int
    cold: dict[str, int]        # strategy -> hash calls of the cold request
    new_sequence: dict[str, int]  # strategy -> hash calls of the same prompt as a new request

    def line(self) -> str:
        return (f"block_size {self.block_size}, {self.prompt_len} tokens (N = {self.prompt_len // self.block_size}): "
                f"cold request {self.cold['recompute']} / {self.cold['incremental']}; same prompt, new Sequence "
                f"{self.new_sequence['recompute']} / {self.new_sequence['incremental']}")


def hash_calls(llm: LLM, prompt: list[int]) -> int:
    """The hash calls one request with ``prompt`` makes, sent alone, run to completion."""
    before = llm.prefix_cache.hash_computations
    send(llm, [prompt])
    return llm.prefix_cache.hash_computations - before


def cells(block_size: int, prompt: list[int], model: str = str(DEMO_MODEL)) -> Cells:
    cold, new = {}, {}
    for strategy in STRATEGIES:
        llm = LLM(model, block_size=block_size, num_kv_blocks=4 * len(prompt) // block_size,
                  hash_strategy=strategy, device="cpu", dtype="float32", enforce_eager=True)
        cold[strategy] = hash_calls(llm, prompt)
        new[strategy] = hash_calls(llm, prompt)
    return Cells(block_size, len(prompt), cold, new)


def measure(model: str = str(DEMO_MODEL)) -> list[Cells]:
    prompt = demo_prompt(0)
    return [cells(8, prompt, model), cells(16, prompt[:512], model)]


def answer(result: list[Cells]) -> list[str]:
    a, b = result
    return [str(a.cold["recompute"]), str(a.cold["incremental"]),
            str(b.new_sequence["recompute"]), str(b.new_sequence["incremental"])]


def report(result: list[Cells]) -> list[str]:
    return ["recompute / incremental hash calls"] + [c.line() for c in result]


if __name__ == "__main__":
    print("\n".join(report(measure())))
