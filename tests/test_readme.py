"""The README follows the code: its reading path names files that exist with about the line
counts it states, it stays short, its quick start is the two commands, its snippet prints
what it shows, and its excerpt of the chapter's table has the counts docs/demo.md quotes."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from demo_output import chapter_counts

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICK_START = ("pip install -r requirements.txt && python run.py",
               "pip install -r requirements.txt && python -m pytest -q tests")
# A reading-path row: | step | what | `file.py` (to `marker`) | lines |: the part of the file
# before the first line holding the marker ("from": from that line to the end); none: all of it.
ROW = re.compile(r"^\| *(\d+) *\|[^|]*\| *`([\w/]+\.py)`(?: \((to|from) `([^`]+)`\))? *\| *([\d,]+) *\|$",
                 re.M)
TOTAL = re.compile(r"About ([\d,]+) lines in all")


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def lines_of(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def part_of(path: str, side: str, marker: str) -> int:
    """Lines of ``path`` before (``to``) or from (``from``) the first line holding ``marker``
    (``# --- x`` stands for a section rule ``# ------ x``)."""
    lines = (ROOT / path).read_text().splitlines()
    rule = re.fullmatch(r"# --- (.+)", marker)
    at = next(i for i, line in enumerate(lines)
              if (re.search(rf"# -+ {re.escape(rule[1])}$", line) if rule else marker in line))
    return at if side == "to" else len(lines) - at


def reading_path() -> list[tuple[int, str, int, int]]:
    """(step, file, stated lines, actual lines) per row."""
    rows = []
    for step, path, side, marker, count in ROW.findall(section("Reading path")):
        actual = part_of(path, side, marker) if side else lines_of(path)
        rows.append((int(step), path, int(count.replace(",", "")), actual))
    assert [row[0] for row in rows] == list(range(1, len(rows) + 1)), rows
    return rows


def test_reading_path_files_exist_with_the_stated_line_counts():
    rows = reading_path()
    assert [path for _, path, _, _ in rows] == ["scheduler.py", "block_manager.py", "prefix_cache.py",
                                               "scheduler.py", "core/engine_core.py", "model.py"]
    for _, path, stated, actual in rows:
        assert abs(actual - stated) <= 0.1 * actual, f"{path}: README says {stated} lines, it has {actual}"


def test_reading_path_total_is_about_the_sum_of_its_parts():
    actual = sum(row[3] for row in reading_path())
    stated = int(TOTAL.search(section("Reading path"))[1].replace(",", ""))
    assert abs(actual - stated) <= 0.1 * actual, f"README says about {stated} lines, the parts have {actual}"


def test_reading_path_is_on_the_first_screen():
    assert README.index("## Reading path") < README.index("About ") < len("\n".join(README.splitlines()[:50]))


def test_readme_is_short_and_starts_with_the_two_commands():
    assert len(README.splitlines()) <= 300
    quick = section("Quick start")
    for command in QUICK_START:
        assert command in quick, command


def test_readme_links_only_files_of_the_repository():
    for target in re.findall(r"`((?:docs|exercises|tests|teaching|tools)/[\w./]+)`", README):
        if not target.endswith("/") and target != "docs/vllm_api.md":  # vllm_api.md: the API's owner
            assert (ROOT / target).exists(), target
    assert "../" not in README and "step14_5.md" not in README  # the chapter is not in a clone


def test_poke_snippet_prints_what_the_readme_shows():
    poke = section("Poke at it")
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", poke, re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README snippet", "exec"), {})
    assert out.getvalue() == shown


def test_excerpt_counts_are_the_ones_docs_demo_quotes():
    from test_readme_counts import quoted_output
    assert chapter_counts(section("Results, in short")) == chapter_counts(quoted_output())
