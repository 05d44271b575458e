"""Running the track's scenarios: every step's, those of track/checks.py and of
track/collisions.py, on a class, each compared with the engine's own observations (the oracle).

A ``Result`` is what one scenario found: what differed, or what the learner's code raised,
and the rule the scenario checks.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prefix_cache import PrefixCache
from track import collisions, lifecycle  # noqa: F401 -- register the scenarios of those files
from track.checks import SCENARIOS, Scenario, differences, oracle, scenarios_of

__all__ = ["SCENARIOS", "Result", "Scenario", "run_scenario", "run_step"]


@dataclass
class Result:
    scenario: str
    ok: bool
    problems: list[str]  # what differed, or what your code raised
    rule: str = ""       # the rule the scenario checks (shown with a failure)

    def message(self) -> str:
        """The failure as the learner reads it: what differed, then the rule it breaks."""
        lines = list(self.problems) + ([f"the rule: {self.rule}"] if self.rule and not self.ok else [])
        return "\n".join(lines)


def run_scenario(s: Scenario, cls: type[PrefixCache]) -> Result:
    try:
        got = s.script(cls)
    except Exception as exc:  # noqa: BLE001 -- the learner's code may raise anything: report it
        unwritten = isinstance(exc, NotImplementedError)  # a step not written yet: no rule broken
        return Result(s.name, False, [raised(exc)], "" if unwritten else s.rule)
    problems = differences(got, oracle(s.script))  # the oracle only when there is something to compare
    return Result(s.name, not problems, problems, s.rule)


HARNESS = ("checks.py", "collisions.py", "lifecycle.py", "runner.py", "test_steps.py", "conftest.py")  # the track's own files


def raised(exc: Exception) -> str:
    """What the learner's code raised, and where in the track (not the engine's frames)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/track/" in f.filename
              and not f.filename.endswith(HARNESS)]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return f"your code raised {type(exc).__name__}: {exc}{where}"


SLOW = "a real generate on the demo model (plain path, no compiled kernels): a few seconds"


def run_step(number: int, cls: type[PrefixCache], with_model: bool = True,
             on_result: Callable[[Result], None] | None = None,
             on_slow: Callable[[str], None] | None = None) -> list[Result]:
    """Every scenario of step ``number`` on ``cls`` (already composed, see track.implementation).
    ``on_result`` sees each result as it comes; ``on_slow`` is told before a slow scenario starts."""
    results = []
    for s in scenarios_of(number):
        if s.needs_model and not with_model:
            continue
        if s.needs_model and on_slow is not None:
            on_slow(SLOW)
        results.append(run_scenario(s, cls))
        if on_result is not None:
            on_result(results[-1])
    return results
