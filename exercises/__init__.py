"""Exercises for the chapter step14_5: predict a number, then let the engine check you.

    python -m exercises                    # the list
    python -m exercises 3                  # exercise 3: the setup and what to predict
    python -m exercises 3 --answer 1 2 3   # check a prediction (a wrong one is not revealed)
    python -m exercises 3 --run            # run the experiment and print what it measures
    python -m exercises 3 --lang zh        # in Chinese (also when LANG / LC_ALL starts with zh)

The answers and their explanations live in ``exercises/answers.json``; read it only after
you have tried. ``tests/test_exercises.py`` checks that every answer there is what the
engine measures now.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType, SimpleNamespace

MODULES = {1: "ex1_snippet_pitfall", 2: "ex2_block_size_8", 3: "ex3_preemption",
           4: "ex4_weak_hash", 5: "ex5_one_token_changed", 6: "ex6_why_it_stopped"}


def exercise(number: int) -> ModuleType:
    """Exercise ``number``'s module: its question (docstring), TITLE, ASKS, HINT, measure,
    answer (the measured values, in ASKS order) and report (lines for --run). Importing it
    imports the engine, and so torch (seconds): only --run needs that."""
    return importlib.import_module(f"exercises.{MODULES[number]}")


def constants_of(number: int) -> dict:
    """Exercise ``number``'s literal top-level constants and its question (``__doc__``), read
    from its source without importing it; ``__doc__ = __doc__.format(name=CONSTANT)`` is applied."""
    tree = ast.parse((Path(__file__).with_name(MODULES[number] + ".py")).read_text(encoding="utf-8"))
    found = {"__doc__": ast.get_docstring(tree, clean=False)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name == "__doc__" and isinstance(value, ast.Call):  # the question names a constant
                found["__format__"] = {kw.arg: kw.value.id for kw in value.keywords}  # zh does the same
                found[name] = found[name].format(**{kw.arg: found[kw.value.id] for kw in value.keywords})
                continue
            try:
                found[name] = ast.literal_eval(value)
            except ValueError:
                pass  # not a literal: not part of the question's text
    return found


def text_of(number: int, lang: str = "en") -> SimpleNamespace:
    """Exercise ``number``'s question (``__doc__``), TITLE, ASKS and HINT, read from its source
    without importing it, so listing, hints and checking a prediction start at once. Its
    literal top-level constants are read, and ``__doc__ = __doc__.format(name=CONSTANT)``.
    ``lang="zh"``: the same in Chinese (exercises/zh.py), its question formatted with the same
    constants; ASKS are Chinese labels, as many and in the same order."""
    found = constants_of(number)
    if lang == "zh":
        from exercises import zh
        return zh.text_of(number, found)
    return SimpleNamespace(**{k: found[k] for k in ("__doc__", "TITLE", "ASKS", "HINT")})
