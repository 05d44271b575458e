"""``python -m track diff``: the chapter's change as a diff, the "before" against the chapter.

The tutorial's method is "read, run, diff against the previous step". Here both steps live in
one file (prefix_cache.py keeps the "before" runnable as ``hash_strategy="recompute"``), so the
diff is cut out of the engine's own source: each method that asks which strategy runs, once
with only its recompute branch (the "before") and once without it (the chapter), each column
followed by its own methods. What is printed is the code that runs, never a copy.
"""
from __future__ import annotations

import difflib
import inspect
import textwrap

from prefix_cache import PrefixCache

SWITCH = 'if self.hash_strategy == "recompute":'
BRANCHED = ("_chain_for_lookup", "_hash_for_save")   # the two places that ask which strategy runs
OWN = {"before": ("_rebuild_chain", "_rehash_block"), "chapter": ("_precompute_block_hashes",)}


def source(name: str) -> list[str]:
    return textwrap.dedent(inspect.getsource(getattr(PrefixCache, name))).splitlines()


def column(lines: list[str], before: bool) -> list[str]:
    """``lines`` (one method) with only the recompute branch (``before``) or without it."""
    at = next(i for i, line in enumerate(lines) if line.strip() == SWITCH)
    indent = len(lines[at]) - len(lines[at].lstrip())
    end = next((i for i in range(at + 1, len(lines))
                if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent), len(lines))
    if before:
        return lines[:at] + [line[4:] for line in lines[at + 1:end]]
    return lines[:at] + lines[end:]


def code_of(side: str) -> list[str]:
    lines = []
    for name in BRANCHED:
        lines += column(source(name), before=side == "before") + [""]
    for name in OWN[side]:
        lines += source(name) + [""]
    return lines


def chapter_diff() -> str:
    """The unified diff from the "before" (recompute) to the chapter (incremental)."""
    return "\n".join(difflib.unified_diff(
        code_of("before"), code_of("chapter"), 'the "before": hash_strategy="recompute"',
        'the chapter: hash_strategy="incremental"', n=2, lineterm=""))
