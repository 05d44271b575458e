"""The exercises: every stored answer (exercises/answers.json) is what the engine measures
now, each measurement is what the chapter's reasoning predicts, and the checker accepts the
right prediction and rejects a wrong one without printing the answer."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exercises import MODULES, exercise, text_of
from exercises.__main__ import main
from exercises.checker import load_answers, normalise

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = load_answers()


@pytest.fixture(autouse=True)
def english_locale(monkeypatch):
    """These tests read the English texts: no LANG / LC_ALL starting with zh from the shell
    (tests/test_exercises_zh.py checks the Chinese ones)."""
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.setenv("LANG", "C.UTF-8")


@pytest.fixture(scope="module")
def measured():
    """Each exercise measured once for the module (the slow part: about a minute in all)."""
    cache = {}

    def get(number: int):
        if number not in cache:
            cache[number] = exercise(number).measure()
        return cache[number]
    return get


@pytest.mark.parametrize("number", sorted(MODULES))
def test_stored_answer_is_what_the_engine_measures(measured, number):
    ex = exercise(number)
    assert ex.answer(measured(number)) == ANSWERS[number]["values"]
    assert len(ANSWERS[number]["values"]) == len(ex.ASKS)


def test_snippet_as_written_hashes_twice_and_caches_nothing_reusable(measured):
    ex1 = exercise(1)
    n = ex1.PROMPT_LEN // ex1.BLOCK  # 256
    chunks16, chunks512, fixed16, fixed512 = measured(1)
    assert (chunks16.hash_calls, chunks16.chain_length, chunks16.cache_entries) == (2 * n, 2 * n, n)
    ends = ex1.PROMPT_LEN // 512  # one save per chunk end
    assert (chunks512.hash_calls, chunks512.chain_length, chunks512.cache_entries) == (n + ends, n + ends, ends)
    assert chunks16.cached_for_new_seq == chunks512.cached_for_new_seq == 0
    for fixed in (fixed16, fixed512):
        assert (fixed.hash_calls, fixed.chain_length, fixed.cache_entries) == (n, n, n)
        assert fixed.cached_for_new_seq == fixed.prompt_len - ex1.BLOCK  # all but the last block


def test_table_cells_follow_the_rule(measured):
    at8, at16 = measured(2)
    n8, n16 = at8.prompt_len // 8, at16.prompt_len // 16
    assert at8.cold == {"recompute": 2 * n8, "incremental": n8}
    assert at8.new_sequence == {"recompute": n8, "incremental": n8}  # 527: last block partial
    assert at16.new_sequence == {"recompute": n16 + 1, "incremental": n16}  # the last block saved again


def test_preempted_sequence_keeps_its_chain(measured):
    ex3 = exercise(3)
    recompute, incremental = measured(3)
    assert recompute.preemptions == incremental.preemptions == 1
    assert recompute.lookups == incremental.lookups == ex3.LOOKUPS  # the number the question states
    assert recompute.full_blocks == incremental.full_blocks == 30 // 2  # the pool split in two
    assert recompute.hash_calls == recompute.lookups * recompute.full_blocks
    assert incremental.hash_calls == 0


def test_weak_hash_costs_misses_never_wrong_tokens(measured):
    outcome = measured(4)
    assert outcome.cache_entries <= outcome.max_entries == 3
    assert outcome.collisions_caught >= 1 and outcome.tokens_identical


def test_one_changed_token(measured):
    ex5 = exercise(5)
    for outcome in measured(5):
        kept = ex5.POSITION // outcome.block_size
        assert outcome.cached_tokens == kept * outcome.block_size
        assert outcome.changed_hashes == outcome.full_blocks - kept


def test_why_it_stopped_reads_each_reason_off_the_output(measured):
    """Exercise 6: each answer is the request's own ``cache_miss_reason``; the cached tokens agree
    with where it stopped, and the evicted block's reason says which eviction and for whom."""
    ex6 = exercise(6)
    stops = {s.label: s for s in measured(6)}
    assert [stops[k].code for k in "abcde"] == ["partial", "never-saved", "partial", "last-token", "salt"]
    for stop in stops.values():
        assert stop.cached_tokens == 16 * (stop.reason.block or 0)
    assert stops["d"].reason.block == 512 // 16 - 1  # the block holding the last token
    evicted = stops["f"].reason
    assert evicted.block == 20 and "the cache's eviction" in evicted and "for request" in evicted
    assert ex6.answer(measured(6))[4] == str(evicted.block)


def test_listing_names_every_exercise(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for number in MODULES:
        assert f"{number}. {exercise(number).TITLE}" in out


@pytest.mark.parametrize("number", sorted(MODULES))
def test_checker_accepts_the_right_prediction(capsys, number):
    assert main([str(number), "--answer", *ANSWERS[number]["values"]]) == 0
    assert capsys.readouterr().out.startswith("Right.")


def wrong_predictions(right: list[str]):
    """The right values with one of them changed, for each position in turn."""
    for wrong_at in range(len(right)):
        wrong = list(right)
        wrong[wrong_at] = "1000" if right[wrong_at] != "1000" else "7"
        yield wrong


@pytest.mark.parametrize("number", sorted(MODULES))
def test_checker_rejects_a_wrong_prediction_without_the_answer(capsys, number):
    right = ANSWERS[number]["values"]
    for wrong in wrong_predictions(right):
        assert main([str(number), "--answer", *wrong]) == 1
        out = capsys.readouterr().out
        assert "Right" not in out and squash(ANSWERS[number]["why"][:60]) not in squash(out)
        for value in set(right) - set(wrong) - {str(number)}:
            assert not re.search(rf"\b{re.escape(value)}\b", out), (value, out)


@pytest.mark.parametrize("number", sorted(MODULES))
def test_question_and_hint_do_not_print_the_explanation(capsys, number):
    for argv in ([str(number)], [str(number), "--hint"]):
        assert main(argv) == 0
        assert squash(ANSWERS[number]["why"][:60]) not in squash(capsys.readouterr().out)


@pytest.mark.parametrize("number", sorted(MODULES))
def test_text_read_from_the_source_is_the_modules(number):
    """What the listing, hints and checker read without importing equals the imported module's."""
    text, module = text_of(number), exercise(number)
    assert (text.__doc__, text.TITLE, text.ASKS, text.HINT) == (module.__doc__, module.TITLE,
                                                                 module.ASKS, module.HINT)


def test_listing_hints_and_checking_do_not_import_torch(tmp_path):
    """Only --run needs the engine: the rest starts at once, without torch (seconds to import)."""
    script = ("import sys\nfrom exercises.__main__ import main\n"
              "for argv in ([], ['3'], ['3', '--hint'], ['3', '--answer', '1', '2', '3']):\n"
              "    main(argv)\n"
              "print('torch imported:', 'torch' in sys.modules)\n")
    env = {**os.environ, "LANG": "C.UTF-8"}
    env.pop("LC_ALL", None)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("torch imported: False")
    assert "3. " + text_of(3).TITLE in run.stdout


def test_normalise_reads_commas_and_words():
    assert normalise(["512,", "256", "0,264"]) == ["512", "256", "0", "264"]
    assert normalise(["3", "No", "same"]) == ["3", "no", "equal"]


def test_readme_gives_no_answer_away():
    readme = squash((ROOT / "README.md").read_text())
    for number in MODULES:
        assert squash(ANSWERS[number]["why"][:60]) not in readme
    assert not re.search(r"\b33 (vs|/) 32\b", readme)  # exercise 2's point
    assert "<details>" not in readme


def squash(text: str) -> str:
    return " ".join(text.split())
