"""The README's exercises: each answer it gives is what the exercise measures now, and the
measurement is the one the chapter's reasoning predicts (so neither can drift)."""
from __future__ import annotations

from pathlib import Path

import pytest

from demo_output import squash
from exercises import (ex1_snippet_pitfall, ex2_block_size_8, ex3_preemption, ex4_weak_hash,
                       ex5_one_token_changed)
from exercises.common import demo_prompt, tiny_long_checkpoint

README = squash((Path(__file__).resolve().parent.parent / "README.md").read_text())


def in_readme(line: str) -> bool:
    return squash(line) in README


@pytest.fixture(scope="module")
def pitfall(tmp_path_factory):
    return ex1_snippet_pitfall.measure(tiny_long_checkpoint(str(tmp_path_factory.mktemp("tiny_long"))))


def test_snippet_as_written_hashes_twice_and_caches_nothing_reusable(pitfall):
    n = ex1_snippet_pitfall.PROMPT_LEN // ex1_snippet_pitfall.BLOCK  # 256
    chunks16, chunks512, fixed16, fixed512 = pitfall
    assert (chunks16.hash_calls, chunks16.chain_length, chunks16.cache_entries) == (2 * n, 2 * n, n)
    ends = ex1_snippet_pitfall.PROMPT_LEN // 512  # one save per chunk end
    assert (chunks512.hash_calls, chunks512.chain_length, chunks512.cache_entries) == (n + ends, n + ends, ends)
    assert chunks16.cached_for_new_seq == chunks512.cached_for_new_seq == 0
    for fixed in (fixed16, fixed512):
        assert (fixed.hash_calls, fixed.chain_length, fixed.cache_entries) == (n, n, n)
        assert fixed.cached_for_new_seq == fixed.prompt_len - ex1_snippet_pitfall.BLOCK  # all but the last block
    for outcome in pitfall:
        assert in_readme(outcome.line()), outcome.line()


def test_block_size_8_table():
    lines = ex2_block_size_8.measure()
    n8 = len(demo_prompt(0)) // 8
    assert lines[0].startswith(f"block_size 8, 527 tokens (N = {n8}): cold request {2 * n8} / {n8};")
    assert "same prompt, new Sequence 33 / 32" in lines[1]  # 512 tokens: the last block is saved again
    for line in lines:
        assert in_readme(line), line


def test_preempted_sequence_keeps_its_chain():
    recompute, incremental = ex3_preemption.measure()
    assert recompute.preemptions == incremental.preemptions == 1
    assert recompute.lookups == incremental.lookups > 1  # it retried while blocks were short
    assert recompute.hash_calls == recompute.lookups * recompute.full_blocks
    assert incremental.hash_calls == 0
    for outcome in (recompute, incremental):
        assert in_readme(outcome.line()), outcome.line()


def test_weak_hash_costs_misses_never_wrong_tokens():
    outcome = ex4_weak_hash.measure()
    assert outcome.cache_entries <= 3 and outcome.collisions_caught >= 1
    assert outcome.tokens_identical
    assert in_readme(outcome.line()), outcome.line()


def test_one_changed_token():
    for outcome in ex5_one_token_changed.measure():
        kept = ex5_one_token_changed.POSITION // outcome.block_size
        assert outcome.cached_tokens == kept * outcome.block_size
        assert outcome.changed_hashes == outcome.full_blocks - kept
        assert in_readme(outcome.line()), outcome.line()

