"""``run.py --plot``: the hash sweep counts what the rule says at every length, and both
figures are written as PNG files."""
from __future__ import annotations

from teaching import demo_plots
from run import RoundResult

PNG = b"\x89PNG\r\n\x1a\n"


def test_hash_sweep_follows_the_rule():
    lengths = (64, 128, 256)
    sweep = demo_plots.hash_sweep(block_size=16, lengths=lengths, repeats=1)
    for i, length in enumerate(lengths):
        n = length // 16
        assert sweep[("recompute", "cold")][i].calls == 2 * n
        assert sweep[("incremental", "cold")][i].calls == n
        assert sweep[("recompute", "re-lookup")][i].calls == n
        assert sweep[("incremental", "re-lookup")][i].calls == 0


def test_plots_are_written(tmp_path, capsys):
    stats = dict(prompt_tokens_computed=100, prompt_tokens_cached=400)
    rounds = [RoundResult([[1]], 1.0, [0.1], stats, 0.0)] * 2
    paths = demo_plots.write_all(tmp_path / "figs", {"cache off": rounds, "incremental": rounds}, 16,
                                 lengths=(64, 128))
    for path in paths:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000
    assert "Hashing per request" in capsys.readouterr().out
