"""The track's pytest options: ``python -m pytest track [--impl mine|reference|skeleton] [--only]``."""
from __future__ import annotations

from track import IMPLS


def pytest_addoption(parser) -> None:
    group = parser.getgroup("track", "the build-it-yourself track (track/README.md)")
    group.addoption("--impl", choices=IMPLS, default="mine",
                    help="whose code: yours (track/my_prefix_cache.py, default), the engine's own, "
                         "the untouched skeleton")
    group.addoption("--only", action="store_true",
                    help="each step checks its own methods alone (the engine's code for the others)")
