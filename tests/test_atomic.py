"""Rooms that own their state, and what two Ctrl-Cs in one step leave.

* the three rooms (block_manager.py, prefix_cache.py, scheduler.py) carry no rollback code (no
  snapshot, restore, journal or undo log) and import nothing from core/: a step is a plan and
  a commit (scheduler.py), not a copy of the world and its undoing;
* a second Ctrl-C anywhere after a first one still leaves the step committed whole or not at
  all, and the step run again leaves what it leaves on an engine without interrupts;
* a KV-event subscriber that raises is that subscriber's failure alone;
* a crafted ``cache_salt`` cannot start its chain where another request's chain goes on,
  under every hash algorithm.
"""
from __future__ import annotations

import ast
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import add, greedy, make_llm, random_prompt
from invariants import assert_idle, check_accounting
from line_faults import TRACED, fingerprint
from test_interrupts import PREFIX_DIR, assert_nothing_committed, new_core, run_clean, start

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("block_manager.py", "prefix_cache.py", "scheduler.py")


# ----------------------------------------------------------------------------- the rooms

@pytest.mark.parametrize("room", ROOMS)
def test_a_room_carries_no_rollback_code(room):
    text = (ROOT / room).read_text().lower()
    for word in ("journal", "undo log", "_skip", "keep(", "snapshot", "restore", "rollback"):
        assert word not in text, f"{room} mentions {word!r}"


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_nothing_from_the_engine_core(room):
    tree = ast.parse((ROOT / room).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {n for n in names if n.split(".")[0] in ("core", "fast", "vllm_api", "engine")}


# ----------------------------------------------------------------------------- a second interrupt

@pytest.fixture(autouse=True)
def _checkpoint(llama_dir):
    PREFIX_DIR[:] = [llama_dir]  # the interrupt sweep's workload runs on it


class TwoFaults:
    """Sends SIGINT at the ``first``-th traced line, then again ``gap`` traced lines later.
    ``after_first`` counts the lines run after the first.

    Python drops a trace function that raises, so a profile function (which never raises)
    puts it back at the next call, on every frame of the stack too: the lines of the frame
    that handles the first interrupt are counted and can be interrupted as well."""

    def __init__(self, first: int, gap: int | None = None) -> None:
        self.first, self.gap, self.count, self.after_first, self.fired = first, gap, 0, 0, 0

    def __enter__(self) -> TwoFaults:
        sys.setprofile(self._rearm)
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)  # first: it would put the trace function back
        sys.settrace(None)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in TRACED else None

    def _rearm(self, frame, event, arg) -> None:
        if self.fired and sys.gettrace() is None:
            sys.settrace(self._call)
            while frame is not None:
                if frame.f_code.co_filename in TRACED:
                    frame.f_trace = self._line
                frame = frame.f_back

    def _line(self, frame, event, arg):
        if event != "line":
            return self._line
        self.count += 1
        if self.fired:
            self.after_first += 1
        if self.count == self.first or (self.gap is not None and self.fired == 1
                                        and self.after_first == self.gap):
            self.fired += 1
            signal.raise_signal(signal.SIGINT)  # raises here, or where the engine lets it land
        return self._line


def _interrupted_twice(first: int, gap: int) -> tuple[dict, dict, object]:
    core = new_core()
    start(core)
    before = fingerprint(core)
    with TwoFaults(first, gap) as faults:
        with pytest.raises(KeyboardInterrupt):
            core.step()
    return before, fingerprint(core), (core, faults)


def _clean_first_step() -> dict:
    core = new_core()
    start(core)
    core.step()
    return fingerprint(core, times=False)


def _whole_or_nothing(before: dict, core, what: str) -> None:
    """The step happened whole, or committed nothing and, run again, happens whole."""
    check_accounting(core)
    done, outputs = _clean_first_step(), core.stream.drain()
    if fingerprint(core, times=False) != done:
        assert not outputs, what
        assert_nothing_committed(before, fingerprint(core), what)
        core.step()
    assert fingerprint(core, times=False) == done, what


def test_a_second_interrupt_anywhere_after_the_first_leaves_the_step_whole_or_uncommitted():
    """The first step (admissions, lookups, the in-flight wait, saves) interrupted at several
    lines; for each, a second Ctrl-C at every line run after the first."""
    _, per_step = run_clean()
    length = len(per_step[0])
    swept = 0
    for first in (length // 5, 2 * length // 5, 3 * length // 5, 4 * length // 5):
        core = new_core()
        start(core)
        with TwoFaults(first) as probe:  # how many lines run after the first Ctrl-C
            with pytest.raises(KeyboardInterrupt):
                core.step()
        assert probe.after_first > 5
        for gap in range(1, probe.after_first + 1):
            before, _, (core, faults) = _interrupted_twice(first, gap)
            assert faults.fired == 2, (first, gap)
            _whole_or_nothing(before, core, f"interrupts at line {first} and {gap} lines later")
            swept += 1
    assert swept > 30


def test_after_two_interrupts_the_workload_gives_the_same_tokens():
    expected, per_step = run_clean()
    before, _, (core, _) = _interrupted_twice(len(per_step[0]) // 2, 7)
    _whole_or_nothing(before, core, "two interrupts")
    outputs = {}
    while core.has_unfinished:
        outputs.update((o.request_id, o) for o in core.step())
    assert {r: [c.token_ids for c in o.outputs] for r, o in outputs.items()} == \
        {r: [c.token_ids for c in o.outputs] for r, o in expected.items()}
    assert_idle(core)


# ----------------------------------------------------------------------------- KV events

def _events_of(llama_dir, broken: bool) -> tuple[list, list, list, int]:
    llm = make_llm(llama_dir, block_size=4, kv_events_config={"enable_kv_cache_events": True,
                                                              "publisher": "null"})
    stream, seen_before, seen_after = llm.llm_engine.kv_events, [], []

    def failing(batch):
        raise RuntimeError("subscriber bug")

    for callback in (seen_before.append, failing, seen_after.append)[::1 if broken else 2]:
        stream.subscribe(callback)
    outs = llm.generate([random_prompt(9, 1), random_prompt(13, 2)], greedy(4), use_tqdm=False)
    events = lambda seen: [[repr(e) for e in batch.events] for batch in seen]  # noqa: E731
    return ([o.outputs[0].token_ids for o in outs], events(seen_before), events(seen_after),
            stream.failed_sends)


def test_a_kv_event_subscriber_that_raises_fails_alone(llama_dir):
    """A subscriber raising between two good ones: the outputs, and both good subscribers'
    streams, are exactly those of an engine without it; its failures are counted."""
    tokens, before, after, failed = _events_of(llama_dir, broken=True)
    clean_tokens, clean_before, clean_after, clean_failed = _events_of(llama_dir, broken=False)
    assert tokens == clean_tokens and [len(t) for t in tokens] == [4, 4]
    assert before == after == clean_before == clean_after and len(before) > 0
    assert failed == len(before) and clean_failed == 0


# ----------------------------------------------------------------------------- the salt's domain

ALGOS = (None, "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _cache(algo, block_size: int = 4):
    from block_manager import BlockManager
    from prefix_cache import PrefixCache
    from vllm_api.block_hash import hash_fn_for

    cache = PrefixCache(BlockManager(8, block_size))
    if algo is not None:
        cache.hash_fn = hash_fn_for(algo)
    return cache


def _chain(cache, tokens, salt=None) -> list[int]:
    from scheduler import Sequence

    seq = Sequence(tokens, 1, cache_salt=salt, root_hash=cache.root_hash(salt))
    cache._precompute_block_hashes(seq)
    return list(seq._block_hashes)


@pytest.mark.parametrize("algo", ALGOS, ids=lambda a: a or "xxh3_64")
def test_a_crafted_salt_cannot_take_another_requests_chain(algo):
    """The attack: a salt whose UTF-8 bytes are the int64 bytes of a victim's first block
    (token ids are small, so the bytes are valid UTF-8). Hashed as a block, the salt's root
    would be the victim's first hash, and a prompt of the victim's later blocks would then
    take the victim's later hashes."""
    cache, bs = _cache(algo), 4
    victim = _ascii_prompt(4 * bs, seed=5)
    for salt_tokens in (victim[:bs], victim[:2 * bs], victim[:1]):
        salt = np.asarray(salt_tokens, dtype="<i8").tobytes().decode()
        victim_chain = _chain(cache, victim)
        attacker = _chain(cache, victim[len(salt_tokens):] if len(salt_tokens) % bs == 0 else victim, salt)
        assert cache.root_hash(salt) not in victim_chain + [0]
        assert not set(attacker) & set(victim_chain), f"salt {salt!r} joined the victim's chain"


def test_salts_differ_from_each_other_and_from_no_salt():
    cache = _cache(None)
    roots = {cache.root_hash(s) for s in ("a", "a\x00", "", "ab", "a" * 8, "a" * 9)}
    assert len(roots) == 6 and 0 not in roots


def test_the_crafted_salt_denies_the_victim_no_cache_hit(llama_dir):
    """End to end: the attacker's salted request first, then the victim twice: the repeat hits
    all its full blocks (before, the attacker's blocks held the victim's later hashes, and the
    repeat got only its first block from cache)."""
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=64)
    victim = _ascii_prompt(17, seed=9)
    salt = np.asarray(victim[:4], dtype="<i8").tobytes().decode()
    llm.generate([{"prompt_token_ids": victim[4:], "cache_salt": salt}], greedy(1), use_tqdm=False)
    llm.generate([{"prompt_token_ids": victim}], greedy(1), use_tqdm=False)
    (again,) = llm.generate([{"prompt_token_ids": victim}], greedy(1), use_tqdm=False)
    assert again.num_cached_tokens == 16


def _ascii_prompt(n: int, seed: int) -> list[int]:
    """Token ids below 128: their int64 bytes are valid UTF-8, so they can be a salt's."""
    return [t % 127 + 1 for t in random_prompt(n, seed)]


def test_a_generate_whose_clean_up_is_cut_short_leaves_nothing_running(llama_dir, monkeypatch):
    """A Ctrl-C in a step, then a second one at generate()'s clean-up line (before it aborted
    anything): the call is gone, so its requests are dropped by the next step (nobody waits for
    them), and the next call answers as a fresh engine does."""
    llm = make_llm(llama_dir, fast_paths=False)
    prompts, check = [random_prompt(9, 90), random_prompt(12, 91)], random_prompt(7, 92)
    want = llm.generate([check], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    core = llm.llm_engine.engine_core
    run, cancel = core.model_runner.run, core.cancel

    def interrupted_run(*args, **kwargs):
        raise KeyboardInterrupt("first")

    def interrupted_cancel(sink=None):
        raise KeyboardInterrupt("second, at the clean-up line")

    monkeypatch.setattr(core.model_runner, "run", interrupted_run)
    monkeypatch.setattr(core, "cancel", interrupted_cancel)
    with pytest.raises(KeyboardInterrupt, match="second"):
        llm.generate(prompts, greedy(100), use_tqdm=False)  # would outlast the next call
    monkeypatch.setattr(core.model_runner, "run", run)
    monkeypatch.setattr(core, "cancel", cancel)
    assert llm.llm_engine.get_num_unfinished_requests() == 2  # left behind, to the next step
    (out,) = llm.generate([check], greedy(4), use_tqdm=False)
    assert out.outputs[0].token_ids == want
    assert_idle(llm)
    check_accounting(llm)
