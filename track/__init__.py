"""The build-it-yourself track: you write the chapter's methods inside the working engine.

The block manager, the scheduler and the model are given; the prefix cache's chapter methods
are emptied (track/skeleton.py) and you write them back in five steps, checked one at a time
against the engine itself as the oracle (track/checks.py, collisions.py, lifecycle.py): hash
counts per scenario (the chapter's table), the chain's values, the hits, a sequence's whole life
(preemption, re-admission, twins), and the tokens of a real ``generate``.
``python -m track`` lists the steps; track/README.md (English) and track/README.zh-CN.md
(Chinese) are the instructions. The reference solution is the engine's own prefix_cache.py.

Which code runs in a check (``implementation``): step N uses your methods of steps 1..N and
the engine's for the later steps (you have not written them yet); with ``only=True``, your
methods of step N alone, the engine's for every other step.
"""
from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from prefix_cache import PrefixCache

HERE = Path(__file__).resolve().parent
SKELETON = HERE / "skeleton.py"
MINE = HERE / "my_prefix_cache.py"  # the learner's copy (git-ignored): python -m track start
CLASS_NAME = "MyPrefixCache"
IMPLS = ("mine", "reference", "skeleton")


@dataclass(frozen=True)
class Step:
    number: int
    title: str
    methods: tuple[str, ...]  # the chapter's methods this step writes (a method may span steps)


STEPS = (
    Step(1, "the chain hash", ("_chain_hash",)),
    Step(2, "the cold precompute", ("_precompute_block_hashes",)),
    Step(3, "the lookup", ("_lookup_prefix_cache",)),
    Step(4, "the save during prefill", ("_do_prefill_step", "_save_prefix_cache", "_hash_for_save")),
    Step(5, "the \"before\" as a baseline", ("_rebuild_chain", "_hash_for_save")),
)
CHAPTER_METHODS = tuple(dict.fromkeys(m for step in STEPS for m in step.methods))


class TrackError(Exception):
    """Something the learner can fix (no copy yet, a missing class); printed, not a traceback."""


def step(number: int) -> Step:
    for s in STEPS:
        if s.number == number:
            return s
    raise TrackError(f"there is no step {number}: the steps are 1 to {len(STEPS)}")


def load_class(impl: str) -> type[PrefixCache]:
    """The class to check: the learner's copy, the engine's own, or the untouched skeleton."""
    if impl == "reference":
        return PrefixCache
    if impl == "mine" and not MINE.exists():
        raise TrackError("no track/my_prefix_cache.py yet: run  python -m track start")
    module = importlib.import_module({"mine": "track.my_prefix_cache", "skeleton": "track.skeleton"}[impl])
    module = importlib.reload(module)  # a long-lived process sees the file as it is now
    cls = getattr(module, CLASS_NAME, None)
    if not (isinstance(cls, type) and issubclass(cls, PrefixCache)):
        raise TrackError(f"{module.__file__} must define class {CLASS_NAME}(PrefixCache)")
    return cls


def implementation(cls: type[PrefixCache], number: int, only: bool = False) -> type[PrefixCache]:
    """The class step ``number`` checks: ``cls``'s chapter methods of the steps under test
    (1..number, or ``number`` alone with ``only``), the engine's for the others. Helpers the
    learner added to ``cls`` stay available."""
    tested = {number} if only else set(range(1, number + 1))
    mine = {m for s in STEPS if s.number in tested for m in s.methods}
    if cls is not PrefixCache:
        own = cls.__mro__[:cls.__mro__.index(PrefixCache)]  # the learner's classes, above the engine's
        inherited = [m for m in sorted(mine) if not any(m in vars(k) for k in own)]
        if inherited:
            raise TrackError(f"{cls.__name__} does not define {', '.join(inherited)}: it would run "
                             f"the engine's own code. Write it in track/my_prefix_cache.py.")
    engine = {m: getattr(PrefixCache, m) for m in CHAPTER_METHODS if m not in mine}
    return type(f"{cls.__name__}Step{number}", (cls,), engine)


def start(force: bool = False) -> str:
    """Copy the skeleton to the learner's file (``force``: over an existing one, kept as .bak)."""
    if MINE.exists() and not force:
        return f"{MINE.relative_to(HERE.parent)} already exists: write there (python -m track reset starts over)"
    if MINE.exists():
        shutil.copyfile(MINE, MINE.with_suffix(".py.bak"))
    shutil.copyfile(SKELETON, MINE)
    return f"wrote {MINE.relative_to(HERE.parent)}: a copy of the skeleton, yours to fill in"
