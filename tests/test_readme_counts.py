"""docs/demo.md quotes one complete ``python run.py`` output; rerun it and check every count
it shows (the chapter's table and the per-round table), so the docs cannot drift from the
code. Timing columns are not compared: they are clocks on a shared machine."""
from __future__ import annotations

import re
from pathlib import Path

import run
from demo_output import chapter_counts, round_counts

DEMO_DOC = Path(__file__).resolve().parent.parent / "docs" / "demo.md"
COMMAND = "$ python run.py --threads 1"


def quoted_output() -> str:
    text = DEMO_DOC.read_text()
    start = text.index(COMMAND + "\n")
    return text[start:text.index("```", start)]


def test_demo_doc_counts_are_what_run_py_prints_now(capsys):
    quoted = quoted_output()
    code = run.main(["--no-progress"])  # the quoted run's settings
    live = capsys.readouterr().out
    assert code == 0, live
    assert chapter_counts(live) == chapter_counts(quoted)
    assert round_counts(live) == round_counts(quoted)
    header = re.compile(r"^Model .*?, (\d+) KV blocks of (\d+), (\d+) requests/round, (\d+) new tokens", re.M)
    assert header.search(live).groups() == header.search(quoted).groups()
    assert "-> OK" in quoted and "-> OK" in live
