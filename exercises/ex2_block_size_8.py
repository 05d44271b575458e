"""Exercise 2: predict the chapter's table before run.py prints it.

The demo's longest prompt has 527 tokens. With ``block_size=8`` it has N = 65 full blocks.
Using the rule run.py prints under its table (recompute: every full block at every lookup,
plus each newly computed full block at save; incremental: each full block once per
Sequence), predict every row for both strategies. Then a second case: the first 512 tokens
of the same prompt at ``block_size=16`` (a block multiple, N = 32). Which row changes, and
why? Hint: the block holding the last token is never served from cache.

Check: ``python -m exercises.ex2_block_size_8`` (or ``python run.py --block-size 8``).
"""
from __future__ import annotations

import torch

from teaching.chapter_table import ROWS, STRATEGIES, chapter_rows
from exercises.common import DEMO_MODEL, demo_prompt


def table(block_size: int, prompt: list[int], model: str = str(DEMO_MODEL)) -> dict[str, tuple[int, int]]:
    """Row label -> (recompute calls, incremental calls), counted by the engine."""
    engine_kw = dict(block_size=block_size, max_num_seqs=2, device="cpu", dtype="float32")
    rows = {s: chapter_rows(model, engine_kw, prompt, s, repeats=1) for s in STRATEGIES}
    return {r.label.strip(): (rows["recompute"][r.label].calls, rows["incremental"][r.label].calls)
            for r in ROWS}


def line(block_size: int, prompt: list[int], counts: dict[str, tuple[int, int]]) -> str:
    cells = "; ".join(f"{label} {r} / {i}" for label, (r, i) in counts.items())
    return f"block_size {block_size}, {len(prompt)} tokens (N = {len(prompt) // block_size}): {cells}"


def measure(model: str = str(DEMO_MODEL)) -> list[str]:
    prompt = demo_prompt(0)
    return [line(8, prompt, table(8, prompt, model)), line(16, prompt[:512], table(16, prompt[:512], model))]


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("recompute / incremental hash calls per row")
    for text in measure():
        print(text)
