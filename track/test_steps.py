"""The track under pytest: ``python -m pytest track`` runs every step's scenarios on your
track/my_prefix_cache.py, one test per scenario, named by step and scenario
(``-k step3`` runs step 3). A failure says what differed from the engine and the rule it breaks,
the same message as ``python -m track check N``. Step N uses your methods of steps 1..N and the
engine's for the later ones (``--only``: step N's alone); ``--impl reference`` / ``--impl skeleton``
run the engine's own code / the untouched skeleton instead.
"""
from __future__ import annotations

import functools

import pytest
import torch

from track import TrackError, implementation, load_class
from track.runner import SCENARIOS, Scenario, run_scenario

torch.set_num_threads(1)  # the demo model on a shared CPU: one thread is fastest


@functools.lru_cache(maxsize=None)
def composed(impl: str, number: int, only: bool):
    """The class step ``number`` checks (loaded once per session: your file as it is now)."""
    return implementation(load_class(impl), number, only)


@pytest.mark.parametrize("s", SCENARIOS, ids=[f"step{s.step}: {s.name}" for s in SCENARIOS])
def test_scenario(s: Scenario, request) -> None:
    config = request.config
    try:
        cls = composed(config.getoption("--impl"), s.step, config.getoption("--only"))
    except TrackError as exc:
        pytest.fail(str(exc), pytrace=False)
    result = run_scenario(s, cls)
    if not result.ok:
        pytest.fail(f"step {s.step}, {s.name}:\n{result.message()}", pytrace=False)
