"""The exercises in Chinese (``--lang zh``, exercises/zh.py): every exercise has a Chinese
title, question and hint; the question asks for as many values as ASKS, in the same order;
the checker answers in Chinese, accepts the stored answer and rejects a wrong one without
printing it; LANG / LC_ALL pick Chinese by default; and none of it imports torch."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exercises import MODULES, text_of
from exercises.__main__ import language, main
from exercises.checker import load_answers, normalise
from test_exercises import wrong_predictions
from exercises.zh import TEXTS, fill, width

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = load_answers()
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(autouse=True)
def english_locale(monkeypatch):
    """Each test chooses its language itself: no LANG / LC_ALL from the shell that runs pytest."""
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.setenv("LANG", "C.UTF-8")


def numbered(question: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)\. ", question, flags=re.M)]


@pytest.mark.parametrize("number", sorted(MODULES))
def test_every_exercise_has_chinese_title_question_hint_and_explanation(number):
    zh, en = text_of(number, "zh"), text_of(number)
    for text in (zh.TITLE, zh.__doc__, zh.HINT, TEXTS[number]["WHY"]):
        assert CJK.search(text), text
    assert zh.__doc__.startswith(f"练习 {number}：")
    assert "{" not in zh.__doc__  # a question built from a constant is formatted
    assert len(zh.ASKS) == len(en.ASKS) == len(ANSWERS[number]["values"])


@pytest.mark.parametrize("number", sorted(MODULES))
def test_the_chinese_question_asks_for_the_same_items(number):
    """The numbered items to predict: 1..len(ASKS) in both languages."""
    zh, en = text_of(number, "zh"), text_of(number)
    assert numbered(zh.__doc__) == numbered(en.__doc__) == list(range(1, len(en.ASKS) + 1))


@pytest.mark.parametrize("number", sorted(MODULES))
def test_the_chinese_texts_state_the_same_numbers(number):
    """The Chinese question and explanation carry every number the English ones do (a
    translation that drifted from the English, and so from answers.json, shows here)."""
    def numbers(text: str) -> set[str]:
        return set(re.findall(r"\d+", text))
    assert numbers(text_of(number).__doc__) <= numbers(text_of(number, "zh").__doc__)
    assert numbers(ANSWERS[number]["why"]) <= numbers(TEXTS[number]["WHY"])


def test_question_built_from_a_constant_uses_it_in_chinese_too():
    from exercises import constants_of
    lookups = constants_of(3)["LOOKUPS"]
    assert f"这 {lookups} 次 lookup" in text_of(3, "zh").__doc__
    assert f"those {lookups} lookups" in text_of(3).__doc__


def test_listing_in_chinese(capsys):
    assert main(["--lang", "zh"]) == 0
    out = capsys.readouterr().out
    for number in MODULES:
        assert f"{number}. {TEXTS[number]['TITLE']}" in out
    assert "题目设定" in out and "the setup" not in out


@pytest.mark.parametrize("number", sorted(MODULES))
def test_question_and_hint_in_chinese_do_not_print_the_explanation(capsys, number):
    assert main([str(number), "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"练习 {number}：") and f"--answer {' '.join(f'V{i}' for i in range(1, len(ANSWERS[number]['values']) + 1))}" in out
    assert main([str(number), "--lang", "zh", "--hint"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("提示：")
    for why in (TEXTS[number]["WHY"], ANSWERS[number]["why"]):
        assert squash(why[:40]) not in squash(out)


@pytest.mark.parametrize("number", sorted(MODULES))
def test_chinese_checker_accepts_the_right_prediction(capsys, number):
    assert main([str(number), "--lang", "zh", "--answer", *ANSWERS[number]["values"]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("对了。") and squash(TEXTS[number]["WHY"][:40]) in squash(out)


@pytest.mark.parametrize("number", sorted(MODULES))
def test_chinese_checker_rejects_a_wrong_prediction_without_the_answer(capsys, number):
    right = ANSWERS[number]["values"]
    for wrong in wrong_predictions(right):
        assert main([str(number), "--lang", "zh", "--answer", *wrong]) == 1
        out = capsys.readouterr().out
        assert out.startswith("还不对。") and "对了" not in out
        assert squash(TEXTS[number]["WHY"][:40]) not in squash(out)
        for value in set(right) - set(wrong) - {str(number)}:
            assert not re.search(rf"(?<![\w]){re.escape(value)}(?![\w])", out, flags=re.A), (value, out)


def test_chinese_checker_says_how_many_values_without_the_answer(capsys):
    assert main(["2", "--lang", "zh", "--answer", "1"]) == 1
    out = capsys.readouterr().out
    assert "需要 4 个值" in out and "收到 1 个" in out and "(b) incremental" in out
    for value in ANSWERS[2]["values"]:
        assert not re.search(rf"(?<!\w){value}(?!\w)", out, flags=re.A)


def test_chinese_values_and_separators():
    assert normalise(["3，否、相等"]) == ["3", "no", "equal"]
    assert normalise(["是", "更少"]) == ["yes", "fewer"]
    assert normalise(["3", "一样"]) == ["3", "equal"]


def test_the_locale_picks_the_language(monkeypatch, capsys):
    assert language(None) == "en"
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")
    assert language(None) == "zh" and language("en") == "en"
    assert main(["1", "--hint"]) == 0 and capsys.readouterr().out.startswith("提示：")
    assert main(["1", "--hint", "--lang", "en"]) == 0 and capsys.readouterr().out.startswith("Hint: ")
    monkeypatch.setenv("LC_ALL", "en_US.UTF-8")  # LC_ALL overrides LANG
    assert language(None) == "en"
    monkeypatch.setenv("LC_ALL", "zh_TW.UTF-8")
    monkeypatch.setenv("LANG", "C")
    assert language(None) == "zh"


def test_fill_breaks_between_chinese_characters_never_inside_a_word():
    text = TEXTS[1]["WHY"]
    lines = fill(text, 60).splitlines()
    assert len(lines) > 3 and all(width(line) <= 60 for line in lines)
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")
    words = set(re.findall(r"[!-~]+", text))
    for line in lines:
        for word in re.findall(r"[!-~]+", line):
            assert word in words or any(word in w for w in words), word
    assert not any(line[0] in "，。；：、）" for line in lines)


def test_chinese_listing_hints_and_checking_do_not_import_torch():
    script = ("import sys\nfrom exercises.__main__ import main\n"
              "for argv in ([], ['3'], ['3', '--hint'], ['3', '--answer', '1', '2', '3'],\n"
              "             ['3', '--answer', '15', '360', '0']):\n"
              "    main(argv)\n"
              "print('torch imported:', 'torch' in sys.modules)\n")
    env = {**os.environ, "LANG": "zh_CN.UTF-8", "PYTHONIOENCODING": "utf-8"}
    env.pop("LC_ALL", None)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env, encoding="utf-8")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("torch imported: False")
    assert "3. " + TEXTS[3]["TITLE"] in run.stdout and "还不对。" in run.stdout and "对了。" in run.stdout


def test_the_chinese_readme_names_the_chinese_exercises():
    zh_readme = (ROOT / "README.zh-CN.md").read_text(encoding="utf-8")
    line = next(line for line in zh_readme.splitlines() if "python -m exercises" in line)
    assert "python -m exercises 1 --lang zh" in line
    assert TEXTS[1]["TITLE"] in line or "_do_prefill_step" in line
    for number in MODULES:
        assert squash(TEXTS[number]["WHY"][:40]) not in squash(zh_readme)


def squash(text: str) -> str:
    return " ".join(text.split())
