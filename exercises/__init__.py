"""Exercises for the chapter step14_5: predict a number, then let the engine check you.

    python -m exercises                    # the list
    python -m exercises 3                  # exercise 3: the setup and what to predict
    python -m exercises 3 --answer 1 2 3   # check a prediction (a wrong one is not revealed)
    python -m exercises 3 --run            # run the experiment and print what it measures

The answers and their explanations live in ``exercises/answers.json``; read it only after
you have tried. ``tests/test_exercises.py`` checks that every answer there is what the
engine measures now.
"""
from __future__ import annotations

import importlib
from types import ModuleType

MODULES = {1: "ex1_snippet_pitfall", 2: "ex2_block_size_8", 3: "ex3_preemption",
           4: "ex4_weak_hash", 5: "ex5_one_token_changed"}


def exercise(number: int) -> ModuleType:
    """Exercise ``number``'s module: its question (docstring), TITLE, ASKS, HINT, measure,
    answer (the measured values, in ASKS order) and report (lines for --run)."""
    return importlib.import_module(f"exercises.{MODULES[number]}")
