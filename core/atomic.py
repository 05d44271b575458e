"""Every engine operation happens whole or not at all: ``Atomic`` saves the state of each part
before an operation and, if the operation raises, puts it all back.

Each part owns its state and knows how to save it: the block manager its blocks and free
queue, the prefix cache its maps, the scheduler its queues and sequences, the output
processor its request records (``snapshot()`` returns what ``restore(saved)`` puts back).
Nothing inside the parts is told when an operation starts or ends: the engine core wraps each
step, each request change and each reset in ``atomic.operation()``, and that is all.

Restoring may itself be interrupted (a second Ctrl-C): every ``restore`` sets its state from
the saved copy, so running it again finishes the job, and ``operation`` runs it until it has
run once to its end before the exception goes on. The KV pool's tensors are not saved: a
failed step wrote K/V only into slots of tokens it had not computed before, which the step
run again writes again.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterator, Protocol


class Stateful(Protocol):
    def snapshot(self): ...

    def restore(self, saved) -> None: ...


class Atomic:
    """The parts one operation may change, saved together and restored together."""

    def __init__(self, parts: list[Stateful]) -> None:
        self.parts = list(parts)

    def add(self, part: Stateful) -> None:
        """One more part (the vLLM layer's event stream, say), saved from the next operation on."""
        self.parts = [*self.parts, part]

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        saved = None
        try:
            try:
                saved = [(part, part.snapshot()) for part in self.parts]
                yield
            except BaseException:
                _restore(saved)
                raise
        except BaseException:
            _restore(saved)  # again: a second interrupt may have cut the first restore short
            raise


RESTORE_TRIES = 3  # a restore failing again and again is a bug, not an interrupt


def _restore(saved: list | None) -> None:
    """Put every part back; a restore cut short by another exception is run again."""
    if saved is None:
        return  # the snapshot itself was cut short: nothing had changed yet
    for attempt in range(RESTORE_TRIES):
        try:
            for part, state in saved:
                part.restore(state)
            return
        except BaseException:  # noqa: BLE001 -- the operation's own exception goes on after
            if attempt == RESTORE_TRIES - 1:
                raise


def fields_of(obj) -> dict:
    """A record's fields, its lists, deques, sets and dicts copied (they change in place)."""
    return {name: _copied(value) for name, value in vars(obj).items()}


def put_fields(obj, saved: dict) -> None:
    """Put ``fields_of``'s result back; a container is refilled, so whoever holds it sees it."""
    for name, (value, contents) in saved.items():
        setattr(obj, name, value)
        if contents is not None:
            value.clear()
            (value.update if isinstance(value, (dict, set)) else value.extend)(contents)


def _copied(value) -> tuple:
    if isinstance(value, dict):
        return value, dict(value)
    if isinstance(value, set):
        return value, set(value)
    if isinstance(value, (list, deque)):
        return value, list(value)
    return value, None
