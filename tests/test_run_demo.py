"""run.py's workload at small size: its identical-output check must pass, its table must be live."""
from __future__ import annotations

import run


def test_run_demo_small(llama_dir, capsys):
    code = run.main(["--model", llama_dir, "--num-requests", "3", "--max-tokens", "6",
                     "--block-size", "8", "--no-progress", "--show-blocks", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out
    assert "=== KV pool after step 2 of round 2" in out
    rows = {line.split("  ")[1].strip(): line.split()[-2:] for line in out.splitlines()
            if line.startswith("  cold request") or line.startswith("  same Sequence")}
    cold_recompute, cold_incremental = map(int, rows["cold request (lookup + save)"])
    again_recompute, again_incremental = map(int, rows["same Sequence looked up again"])
    assert cold_recompute == 2 * cold_incremental > 0
    assert again_incremental == 0 and again_recompute == cold_incremental


def test_identical_check_fails_on_mismatch():
    same = ([[1, 2]], [[1, 2], [3]])
    assert run.report_identical({"a": same, "b": same}, 1) == 0
    assert run.report_identical({"a": same, "b": ([[1, 9]], [[1, 2], [3]])}, 1) == 1
    assert run.report_identical({"a": ([[1]], [[2], [3]])}, 1) == 1
