"""Each row of the chapter's table means one thing: the label and definition in
``chapter_table.ROWS`` are the ones run.py prints and the README quotes, and every row's
counts follow the rule printed under the table, for a prompt that is a block multiple and
one that is not."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from teaching import poke
from teaching.chapter_table import ROWS, RULE, STRATEGIES, HashMeter, chapter_llm, chapter_rows, measure_rows
from demo_output import squash
from helpers import random_prompt

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = 8


def by_rule(prompt_len: int, block_size: int) -> dict[str, tuple[int, int]]:
    """(recompute, incremental) per row, from the rule alone.

    A prompt that is a block multiple and fully cached recomputes its last block (its
    logits are needed), and recompute hashes that block again when it is saved.
    """
    n = prompt_len // block_size
    last = 1 if prompt_len % block_size == 0 else 0
    return {ROWS[0].label: (n + n, n),                 # cold: lookup + every block saved
            ROWS[1].label: (n, 0),                     # of which at save
            ROWS[2].label: (n, 0),                     # same Sequence again: one more lookup
            ROWS[3].label: (n + last, n),              # new Sequence: lookup (+ the last block saved)
            ROWS[4].label: (3 * n + n + last, 2 * n)}  # 3 lookups + saves; 2 Sequences


@pytest.mark.parametrize("length", [64, 70])
def test_every_row_follows_the_printed_rule(llama_dir, length):
    engine_kw = dict(block_size=BLOCK, max_num_seqs=2, device="cpu", dtype="float32")
    prompt = random_prompt(length, seed=length)
    rows = {s: chapter_rows(llama_dir, engine_kw, prompt, s, repeats=2) for s in STRATEGIES}
    counts = {r.label: (rows["recompute"][r.label].calls, rows["incremental"][r.label].calls) for r in ROWS}
    assert counts == by_rule(length, BLOCK)


def test_docs_quote_each_row_definition_and_the_rule():
    """docs/demo.md (where the README sends readers for what each row counts) quotes every
    row's definition and the rule; the README quotes the rule."""
    demo = squash((README.parent / "docs" / "demo.md").read_text())
    for row in ROWS:
        assert squash(f"{row.label.strip()}: {row.definition}") in demo, row.label
    for sentence in RULE:
        assert squash(sentence) in demo and squash(sentence) in squash(README.read_text())


def test_measuring_replaces_no_method(llama_dir):
    """The meter wraps the cache's swappable ``hash_fn`` and records through ``recording()``;
    the chapter's methods stay the class's own, and no recording is left behind."""
    prompt = random_prompt(40, seed=2)
    llm = chapter_llm(llama_dir, dict(block_size=BLOCK, max_num_seqs=2, device="cpu"), prompt)
    pc = llm.prefix_cache
    rows = measure_rows(llm, HashMeter(pc), prompt)
    assert rows[ROWS[1].label].calls == 0  # incremental: nothing hashed at save
    assert rows[ROWS[1].label].us == 0.0
    replaced = {"_chain_hash", "_do_prefill_step", "_lookup_prefix_cache", "lookup", "cache_blocks"} & set(vars(pc))
    assert replaced == set() and pc._listeners == []


def test_poke_follows_the_rule():
    """One Sequence of 10 tokens in blocks of 4, looked up twice."""
    recompute, incremental = (poke.poke(s, list(range(10)), 4) for s in STRATEGIES)
    assert [counter for *_, counter in recompute] == [2, 4]
    assert [counter for *_, counter in incremental] == [2, 2]
    chain = incremental[0][0]
    assert len(chain) == 2 and all(used == chain for used, *_ in recompute + incremental)
    assert all(kept == [] for _, kept, _ in recompute) and all(kept == chain for _, kept, _ in incremental)


def test_poke_prints_both_strategies(capsys):
    assert poke.main([]) == 0
    out = capsys.readouterr().out
    assert "Paged Prefix Cache (recompute)" in out and "step14_5 (incremental)" in out
    assert [int(n) for n in re.findall(r"cache.hash_computations +(\d+)", out)] == [2, 4, 2, 2]
