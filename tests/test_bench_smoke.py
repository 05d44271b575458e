"""Smoke test of bench.py: the whole benchmark end to end at a tiny size (a few seconds).

It checks that every part runs and that the report has the shape the project reads; it
says nothing about speed.
"""
from __future__ import annotations

import json

import bench


def tiny_sizes() -> bench.Sizes:
    return bench.Sizes(num_requests=4, a_prompt_min=16, a_prompt_max=48, a_new_tokens=4,
                       b_prefix=32, b_suffix=8, b_new_tokens=4, hash_prompt=128, hash_reps=3,
                       decode_batch=4, decode_prompt=16, decode_steps=2, matmul_n=64,
                       max_batched_tokens=64,  # so later requests find the prefix cached
                       model=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16))


def test_bench_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["--json", str(out)], sizes=tiny_sizes())
    printed = capsys.readouterr().out

    assert "| workload | system |" in printed and "Targets:" in printed
    systems = {(r["workload"], r["system"]) for r in report["runs"]}
    assert len(systems) == 6  # 2 workloads x (ours, HF generate_batch, HF generate)
    for run in report["runs"]:
        assert run["out_tok_s"] > 0 and run["output_tokens"] == 4 * 4
    # The shared prefix must be served from our cache within the run.
    ours_b = next(r for r in report["runs"] if r["system"] == "ours" and "(b)" in r["workload"])
    assert ours_b["extra"]["prompt_tokens_cached"] > 0
    # Hash counts: the chapter's point, and HF rebuilding its chain on every match.
    by_system = {h["system"]: h for h in report["hashing"]}
    blocks = 128 // 16
    assert by_system["ours (incremental)"]["relookup_hashes"] == 0
    assert by_system["ours (recompute)"]["relookup_hashes"] == blocks
    assert by_system["HF match_prefix_blocks (blake2b)"]["relookup_hashes"] == blocks - 1
    assert 0 < report["prefill"]["mfu"] and 0 <= report["decode"]["non_matmul_share"] <= 1
    assert len(report["targets"]) == 4
    assert json.loads(out.read_text())["model"]["params"] == report["model"]["params"]
