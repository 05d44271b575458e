"""Parse what ``python run.py`` prints (and README.md and docs/demo.md quote): the chapter's table and the
per-round table, as counts only (the timing columns vary run to run)."""
from __future__ import annotations

import re

from teaching.chapter_table import ROWS


def chapter_counts(text: str) -> dict[str, tuple[int, int]]:
    """Row label -> (recompute hash calls, incremental hash calls)."""
    counts = {}
    for row in ROWS:
        m = re.search(rf"^  {re.escape(row.label)} +(\d+) +(\d+)$", text, re.M)
        assert m, f"row {row.label!r} not found in:\n{text}"
        counts[row.label] = (int(m[1]), int(m[2]))
    return counts


ROUND_LINE = re.compile(r"^  (cache off|recompute|incremental) +(\d) +([\d.]+)% +(\d+) +(\d+) +[\d.]+ +[\d.]+ "
                        r"+(\d+) +(\d+) +(\d+)$", re.M)


def round_counts(text: str) -> dict[tuple[str, int], tuple]:
    """(engine, round) -> (hit rate %, computed, cached, hashes, evictions, preemptions)."""
    rounds = {(m[1], int(m[2])): (m[3], int(m[4]), int(m[5]), int(m[6]), int(m[7]), int(m[8]))
              for m in ROUND_LINE.finditer(text)}
    assert len(rounds) == 6, f"expected 3 engines x 2 rounds in:\n{text}"
    return rounds


def squash(text: str) -> str:
    """Whitespace-insensitive form, so the docs may wrap a line where run.py does not."""
    return " ".join(text.split())
