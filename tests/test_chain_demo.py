"""``python run.py --chain``: every hash it prints is the real chain hash of that block,
chained from the hash printed for the block before; one changed token changes exactly the
blocks from its own on; the recompute and wait parts count what the rule says."""
from __future__ import annotations

import re

import numpy as np
import pytest
import xxhash

from teaching import chain_view
import run
from engine import LLM

BLOCK, CHANGE_AT = 8, 50


@pytest.fixture(scope="module")
def chain_output(tokenizer_ckpt):
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        code = run.main(["--chain", "--model", tokenizer_ckpt, "--block-size", str(BLOCK),
                         "--change-at", str(CHANGE_AT)])
    args = run.parse_args(["--model", tokenizer_ckpt])
    return code, out.getvalue(), chain_view.chain_prompt(LLM(tokenizer_ckpt, device="cpu"), args)


def part(text: str, number: int) -> str:
    start = text.index(f"\n{number}) ")
    end = text.find(f"\n{number + 1}) ", start)
    return text[start:end if end > 0 else None]


def test_printed_hashes_are_the_chain(chain_output):
    code, out, prompt = chain_output
    assert code == 0, out
    rows = re.findall(r"^ +(\d+) +(\d+)-(\d+) .*?([0-9a-f]{16}) -> ([0-9a-f]{16}) ", part(out, 1), re.M)
    n = len(prompt) // BLOCK
    assert [int(r[0]) for r in rows][:n] == list(range(n))
    parent = 0
    for index, start, end, printed_parent, printed_hash in rows[:n]:
        block = np.asarray(prompt[int(start):int(end) + 1], dtype="<i8").tobytes()
        assert int(printed_parent, 16) == parent
        assert int(printed_hash, 16) == xxhash.xxh3_64_intdigest(block, parent)
        parent = int(printed_hash, 16)
    assert "precomputed at lookup, reused at save" in part(out, 1)
    assert "computed at decode" in part(out, 1)  # decode completed a block too


def test_generated_tokens_are_marked_and_the_cold_count_explained(chain_output):
    _, out, prompt = chain_output
    rows = re.findall(r"^ +(\d+) +(\d+)-(\d+) +(\S+)  ", part(out, 1), re.M)
    assert rows, out
    for _, start, end, generated in rows:
        start, end = int(start), int(end)
        expected = "-" if end < len(prompt) else \
            f"{max(start, len(prompt))}" + ("" if max(start, len(prompt)) == end else f"-{end}")
        assert generated == expected
    assert any(g != "-" for *_, g in rows)  # decode filled a block
    cold = re.search(r"cold (\d+) = (\d+) prompt blocks precomputed at lookup \+ (\d+) block", part(out, 1))
    total, prompt_blocks, decode = map(int, cold.groups())
    assert prompt_blocks == len(prompt) // BLOCK and total == prompt_blocks + decode
    assert decode == sum(g != "-" for *_, g in rows)
    assert f"The chapter's table counts {prompt_blocks} for its cold row" in part(out, 1)


def test_one_changed_token_changes_its_block_and_every_later_one(chain_output):
    _, out, prompt = chain_output
    rows = re.findall(r"^ +(\d+) +\d+-\d+ +[0-9a-f]{16} (==|!=) [0-9a-f]{16}  (\S+)", part(out, 2), re.M)
    changed_block = CHANGE_AT // BLOCK
    assert len(rows) == len(prompt) // BLOCK
    for index, relation, lookup in rows:
        before = int(index) < changed_block
        assert relation == ("==" if before else "!=")
        assert lookup == ("hit" if before else "miss" if int(index) == changed_block else "-")
    assert "the chain property -> holds" in part(out, 2)


def test_recompute_and_wait_parts_follow_the_rule(chain_output):
    _, out, prompt = chain_output
    n = len(prompt) // BLOCK
    total = re.search(r"total +(\d+) \+ (\d+) +(\d+) \+ (\d+) +(\d+) +(\d+)", part(out, 3))
    cold_lookup, cold_save, again_lookup, _, incremental_cold, incremental_again = map(int, total.groups())
    assert cold_lookup == n and cold_save == n + 1  # every prompt block + the decode block, at save
    assert again_lookup == n and incremental_cold == incremental_again == n + 1
    wait = dict(re.findall(r"^  (\w+) *: request 0 made +\d+ hash calls; request 1 waited 1 step\(s\) .* made +(\d+)$",
                           part(out, 4), re.M))
    last = 1 if len(prompt) % BLOCK == 0 else 0  # its last block is recomputed, and saved (recompute hashes it)
    assert int(wait["recompute"]) == 2 * n + last and int(wait["incremental"]) == n


def test_each_lookup_says_why_it_stopped(chain_output):
    """Part 1 prints why the cold and the again lookups stopped, part 2 why the changed prompt's
    did, part 4 each lookup of the waiting copy: the reasons the engine's "miss" events carry."""
    _, out, prompt = chain_output
    n, one = len(prompt) // BLOCK, part(out, 1)
    assert "cold:  block 0: no entry for its hash: never saved" in one
    tail = (f"again: block {n - 1}: it holds the last token (position {len(prompt) - 1})" if len(prompt) % BLOCK == 0
            else f"again: block {n}: tokens {n * BLOCK}-{len(prompt) - 1} are a partial block")
    assert tail in one
    assert f"Its lookup stopped at block {CHANGE_AT // BLOCK}: no entry for its hash: never saved" in part(out, 2)
    waits = re.findall(r"request 1's lookup (\d) stopped at (.*)$", part(out, 4), re.M)
    assert [w[0] for w in waits] == ["1", "2", "1", "2"]  # both strategies, the same lookups
    assert all("in flight (request '0' is computing it)" in w[1] for w in waits[::2])
    assert all("after waiting 1 step for block 0, in flight" in w[1] for w in waits[1::2])


def test_change_position_outside_the_prompt_is_refused(llama_dir):
    args = run.parse_args(["--chain", "--model", llama_dir, "--change-at", "100000"])
    with pytest.raises(ValueError, match="--change-at 100000 is outside the prompt"):
        chain_view.main(args)


def test_text_prompt_needs_a_tokenizer(llama_dir):
    args = run.parse_args(["--chain", "--model", llama_dir, "--prompt", "hello"])
    with pytest.raises(ValueError, match="--prompt needs a checkpoint with a tokenizer"):
        chain_view.main(args)
