"""The README follows the code: its reading path names files that exist with exactly the line
counts it states, it stays short, its quick start is the two commands, its snippet prints
what it shows, and its excerpt of the chapter's table has the counts docs/demo.md quotes."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from demo_output import chapter_counts

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICK_START = ("pip install -r requirements.txt && python run.py",
               "pip install -r requirements.txt && python -m pytest -q tests")
# A reading-path row: | step | what | `file.py` (to `marker`) | lines |: the part of the file
# before the first line holding the marker ("from": from that line to the end; "from `a` to
# `b`": from the first line holding a to the next one holding b); none: all of it.
ROW = re.compile(r"^\| *(\d+) *\|[^|]*\| *`([\w/]+\.py)`"
                 r"(?: \((to|from) `([^`]+)`(?: to `([^`]+)`)?\))? *\| *([\d,]+) *\|$", re.M)
TOTAL = re.compile(r"(?:([\d,]+) lines in all|共 ([\d,]+) 行)")


def section(title: str, text: str = README) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def lines_of(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def find(lines: list[str], marker: str, after: int = -1) -> int:
    """The first line after ``after`` holding ``marker`` (``# --- x`` stands for a section
    rule ``# ------ x``)."""
    rule = re.fullmatch(r"# --- (.+)", marker)
    return next(i for i, line in enumerate(lines) if i > after
                and (re.search(rf"# -+ {re.escape(rule[1])}$", line) if rule else marker in line))


def part_of(path: str, side: str, marker: str, until: str = "") -> int:
    lines = (ROOT / path).read_text().splitlines()
    at = find(lines, marker)
    if until:
        return find(lines, until, at) - at
    return at if side == "to" else len(lines) - at


def reading_path(title: str, text: str = README) -> list[tuple[int, str, int, int]]:
    """(step, file, stated lines, actual lines) per row of the path under ``title``."""
    rows = []
    for step, path, side, marker, until, count in ROW.findall(section(title, text)):
        actual = part_of(path, side, marker, until) if side else lines_of(path)
        rows.append((int(step), path, int(count.replace(",", "")), actual))
    assert [row[0] for row in rows] == list(range(1, len(rows) + 1)), rows
    return rows


def stated_total(text: str) -> int:
    match = TOTAL.search(text)
    return int((match[1] or match[2]).replace(",", ""))


PATHS = {"The chapter path (about 15 minutes)": ["scheduler.py"] + ["prefix_cache.py"] * 4,
         "The engine path (the second read)": ["scheduler.py", "block_manager.py", "prefix_cache.py",
                                               "scheduler.py", "engine.py", "model.py"]}


@pytest.mark.parametrize("title", PATHS)
def test_paths_name_files_that_exist_with_the_stated_line_counts(title):
    rows = reading_path(title)
    assert [path for _, path, _, _ in rows] == PATHS[title]
    for step, path, stated, actual in rows:  # exact: a count that drifts is a count that lies
        assert actual == stated, f"step {step}, {path}: README says {stated} lines, it has {actual}"
    total = sum(row[3] for row in rows)
    stated = stated_total(section(title))
    assert total == stated, f"README says {stated} lines in all, the parts have {total}"


def test_the_chapter_path_is_on_the_first_screen_and_short():
    first_screen = "\n".join(README.splitlines()[:50])
    assert "## The chapter path" in first_screen and " lines in all" in first_screen
    assert sum(row[3] for row in reading_path("The chapter path (about 15 minutes)")) <= 200
    assert README.index("## The chapter path") < README.index("## The engine path")


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


ZH = (ROOT / "README.zh-CN.md").read_text()
ZH_PATH = "章节路径（约 15 分钟）"


def test_the_chinese_readme_gives_the_same_chapter_path_and_commands():
    """README.zh-CN.md, linked from the README's first lines, names the same files, parts,
    line counts and total as the English chapter path, and the same commands to try next."""
    assert "README.zh-CN.md" in "\n".join(README.splitlines()[:5])
    english = reading_path("The chapter path (about 15 minutes)")
    assert reading_path(ZH_PATH, ZH) == english
    assert ROW.findall(section(ZH_PATH, ZH)) == ROW.findall(section("The chapter path (about 15 minutes)"))
    assert stated_total(section(ZH_PATH, ZH)) == stated_total(section("The chapter path (about 15 minutes)"))
    for command in QUICK_START + ("python -m teaching.poke", "python -m exercises 1", "python -m track"):
        assert command in ZH, command
    assert "track/README.zh-CN.md" in ZH


# The chapter's snippets go wrong in five places; both READMEs name each in one line of the
# section where the learner reads the chapter map. Each problem: the words its line must hold.
SNIPPET_PROBLEMS = {
    "en": ("The chapter map", [("`prompt_len`", "`end`", "never defined"), ("`_do_prefill_step`", "2N", "exercise 1"),
                                ("0 hashes", "same `Sequence`"), ("N is never defined",),
                                ("`SequenceGroup`", "`BlockSpaceManager`", "v0", "`Request.block_hashes`")]),
    "zh": ("本章代码在哪里", [("`prompt_len`", "`end`", "从没定义"), ("`_do_prefill_step`", "2N", "练习 1"),
                            ("0 次", "同一个 `Sequence`"), ("N 从没定义",),
                            ("`SequenceGroup`", "`BlockSpaceManager`", "v0", "`Request.block_hashes`")]),
}


@pytest.mark.parametrize("lang", SNIPPET_PROBLEMS)
def test_both_readmes_name_each_snippet_problem_in_one_line_of_the_chapter_map(lang):
    title, problems = SNIPPET_PROBLEMS[lang]
    lines = section(title, README if lang == "en" else ZH).splitlines()
    for words in problems:
        holding = [line for line in lines if all(w in line for w in words)]
        assert len(holding) == 1, (words, holding)
        assert holding[0].startswith("- "), holding[0]


def test_the_chinese_readme_defines_every_term_it_uses():
    """A term the Chinese README uses is defined in its 术语 section, as the English one does."""
    terms = section("术语", ZH)
    for term in ("lifetime", "twin", "in-flight", "cache_salt", "eviction", "preemption"):
        assert f"**{term}" in terms, term
    assert "`(block id, generation)`" in terms
