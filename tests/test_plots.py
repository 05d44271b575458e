"""``run.py --plot``: the hash sweep and the chain diagram count what the rule says, the run
figure finds its wait and its retries, and every figure is written as a PNG file."""
from __future__ import annotations

import pytest

from teaching import demo_plots, step_page
from teaching.chapter_table import STRATEGIES, chapter_rows
from helpers import random_prompt

PNG = b"\x89PNG\r\n\x1a\n"
CPU = dict(device="cpu", dtype="float32")


def test_hash_sweep_follows_the_rule():
    lengths = (64, 128, 256)
    sweep = demo_plots.hash_sweep(block_size=16, lengths=lengths, repeats=1)
    for i, length in enumerate(lengths):
        n = length // 16
        assert sweep[("recompute", "cold")][i].calls == 2 * n
        assert sweep[("incremental", "cold")][i].calls == n
        assert sweep[("recompute", "re-lookup")][i].calls == n
        assert sweep[("incremental", "re-lookup")][i].calls == 0


@pytest.fixture(scope="module")
def chains(llama_dir):
    return {s: demo_plots.chain_trace(llama_dir, CPU, s, blocks=4, block_size=8) for s in STRATEGIES}


def test_chain_diagram_marks_where_each_strategy_hashes(chains):
    """4 prompt blocks + half a block, decoding until a 5th block fills."""
    marks = {s: [demo_plots.phase_marks(t[source], phase, 5)
                 for phase, source in (("lookup", "cold"), ("save", "cold"), ("lookup", "again"))]
             for s, t in chains.items()}
    assert marks["recompute"] == [["hash"] * 4 + [""], ["hash"] * 5, ["hash"] * 5]
    assert marks["incremental"] == [["hash"] * 4 + [""], ["read"] * 4 + ["hash"], ["read"] * 5]
    assert chains["recompute"]["hashes"] == chains["incremental"]["hashes"]  # one chain, two strategies
    assert len(chains["incremental"]["hashes"]) == 5


def test_run_figure_finds_the_wait_and_the_retries(llama_dir):
    data = step_page.record(llama_dir, CPU)
    kinds = [demo_plots.kind_of_step(step["incremental"]) for step in data["steps"]]
    assert kinds.count("wait") == 1
    preempted = [n for n, k in enumerate(kinds) if k == "preempt"]
    assert preempted and all(data["steps"][n]["incremental"]["counters"]["preemptions"] for n in preempted)


def test_plots_are_written(llama_dir, tmp_path, capsys):
    prompt = random_prompt(40, seed=3)
    engine_kw = dict(block_size=8, max_num_seqs=2, **CPU)
    rows = {s: chapter_rows(llama_dir, engine_kw, prompt, s, repeats=1) for s in STRATEGIES}
    paths = demo_plots.write_all(tmp_path / "figs", rows, len(prompt), llama_dir, engine_kw, lengths=(64, 128))
    assert [p.name for p in paths] == ["hash_cost_vs_prompt_length.png", "hash_calls_per_scenario.png",
                                       "cumulative_hash_calls.png", "chain_diagram.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000
    assert "Hashing per request" in capsys.readouterr().out
