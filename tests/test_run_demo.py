"""run.py's workload at small size: its identical-output check must pass, its table must be
live and follow the rule it prints, and --show-blocks / --help must say what they mean."""
from __future__ import annotations

import json
import re
import statistics

import pytest

import run
from teaching.chapter_table import ROWS
from demo_output import chapter_counts, round_counts
from engine import SamplingParams
from helpers import make_llm, random_prompt


def test_run_demo_small(llama_dir, capsys):
    code = run.main(["--model", llama_dir, "--num-requests", "3", "--max-tokens", "6",
                     "--block-size", "8", "--no-progress", "--show-blocks", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out
    header = out.index("\nModel ")
    assert "torch threads: 1" in out[header:header + 300]
    for n in (1, 2):  # both rounds drawn, after the header
        assert out.index(f"=== KV pool after step 2 of round {n}") > header
    counts = chapter_counts(out)
    (cold_r, cold_i), (save_r, save_i), (again_r, again_i) = (counts[r.label] for r in ROWS[:3])
    assert cold_r == 2 * cold_i > 0 and save_r == cold_i and save_i == 0
    assert again_r == cold_i and again_i == 0
    assert "TTFT: time to first token" in out and "Paged Prefix Cache (recompute)" in out
    rounds = round_counts(out)
    assert rounds[("recompute", 1)][1:3] == rounds[("incremental", 1)][1:3]  # same computed, cached
    check_ttft_lines(out)
    assert "N/M tokens computed: N of the sequence's M tokens so far have K/V in the pool" in out and "Twin folding" in out
    shared = int(re.search(r"share their first (\d+) token ids", out)[1])
    assert shared > 0


TTFT_LINE = re.compile(r"round (\d) TTFT ms: recompute ([\d.]+), incremental ([\d.]+), a gap of "
                       r"([\d.]+) ms; (recompute|incremental) ran first this round")


def check_ttft_lines(out: str) -> None:
    """Each round's TTFT line agrees with the table, and the strategies alternate going first."""
    lines = TTFT_LINE.findall(out)
    assert [(int(n), first) for n, *_, first in lines] == [(1, "recompute"), (2, "incremental")]
    for n, r, i, gap, _ in lines:
        r, i, gap = float(r), float(i), float(gap)
        assert abs(gap - abs(r - i)) <= 0.15
        for engine, mean in (("recompute", r), ("incremental", i)):
            row = re.search(rf"^  {engine} +{n} +[\d.]+% +\d+ +\d+ +([\d.]+) ", out, re.M)
            assert abs(float(row[1]) - mean) <= 0.1


def test_html_writes_the_page_and_prints_its_counts(llama_dir, tmp_path, capsys):
    page = tmp_path / "steps.html"
    assert run.main(["--model", llama_dir, "--html", str(page), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    payload = re.search(r'<script id="data" type="application/json">(.*?)</script>', page.read_text(), re.S)[1]
    data = json.loads(payload)
    last = data["steps"][-1]
    for name, strategy in (("Paged Prefix Cache (recompute)", "recompute"), ("step14_5 (incremental)", "incremental")):
        assert f"{name} {last[strategy]['counters']['hash_computations']}" in out
    assert f"{len(data['steps'])} engine steps" in out and "#step=1" in out


def test_screenshot_needs_the_page(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--screenshot", "x.png"])
    assert "give --html FILE too" in capsys.readouterr().err


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: cuda when available)") == 1
    assert "(default: 16)" in text and "(default: 0)" in text  # real defaults are still shown


def test_pool_drawing_names_each_cached_block_by_its_hash(llama_dir):
    llm = make_llm(llama_dir, block_size=8, max_num_batched_tokens=24)
    llm.add_request(random_prompt(40, seed=1), SamplingParams(max_tokens=2, temperature=0.0))
    llm.add_request(random_prompt(40, seed=1), SamplingParams(max_tokens=2, temperature=0.0))
    llm.step()  # 24 tokens of the first request: 3 blocks cached, the second waits
    drawing = run.draw_pool(llm, "after step 1")
    cached = [b for b in llm.block_manager.blocks if b.block_hash is not None]
    assert len(cached) == 3
    for block in cached:
        assert f"{block.block_id}:{block.block_hash:016x}"[:len(str(block.block_id)) + 7] in drawing
    assert "waiting: 1, seqs [1]" in drawing


def test_identical_check_fails_on_mismatch():
    same = ([[1, 2]], [[1, 2], [3]])
    assert run.report_identical({"a": same, "b": same}, 1) == 0
    assert run.report_identical({"a": same, "b": ([[1, 9]], [[1, 2], [3]])}, 1) == 1
    assert run.report_identical({"a": ([[1]], [[2], [3]])}, 1) == 1


def test_the_demo_never_builds_the_compiled_kernel(llama_dir, tmp_path, monkeypatch, capsys):
    """``python run.py`` does not pay for compiling: its engines are eager (no build of
    fast/kernels.py's C++ decode kernel lands in an empty extensions directory)."""
    from fast import kernels
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    kernels.compiled_kernels.cache_clear()
    try:
        code = run.main(["--model", llama_dir, "--num-requests", "2", "--max-tokens", "3",
                         "--block-size", "8", "--no-progress"])
        assert code == 0, capsys.readouterr().out
        assert list(tmp_path.iterdir()) == []
    finally:
        kernels.compiled_kernels.cache_clear()
