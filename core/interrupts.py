"""Where a Ctrl-C may land in an engine operation: in the forward, or at the operation's end.

Every operation of the engine core (a step, queueing requests, an abort, a reset) runs inside
``interrupts_held()``: a Ctrl-C that arrives there is noted and raised as ``KeyboardInterrupt``
when the operation ends, so its bookkeeping runs whole. A step opens ``interrupts_allowed()``
around its forward and sampling, the one long part, where a Ctrl-C lands at once (one noted
before it lands as the region opens): that stops the step before its commit, which leaves the
engine as it was. Other exceptions are kept out of the bookkeeping by construction: what may
raise (a hash function, a tokenizer, a hook) runs before anything changes, or is caught for
its own request.

Only the main thread receives signals; elsewhere, and where the process does not run a Python
SIGINT handler (ignored, or the default action), both are no-ops.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class _Held:
    """The main thread's state: how deep the held sections go, the handler they replaced, and
    the Ctrl-C noted meanwhile."""

    depth = 0
    previous = None
    arrived: list = []


def _note(signum, frame) -> None:
    _Held.arrived.append((signum, frame))


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    if not _main() or (_Held.depth == 0 and not callable(signal.getsignal(signal.SIGINT))):
        yield
        return
    if _Held.depth == 0:
        _Held.previous, _Held.arrived = signal.getsignal(signal.SIGINT), []
        signal.signal(signal.SIGINT, _note)
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        if _Held.depth == 0:
            signal.signal(signal.SIGINT, _Held.previous)
            _deliver()


@contextlib.contextmanager
def interrupts_allowed() -> Iterator[None]:
    """Inside a held section: a Ctrl-C lands here at once (and one noted before, as it opens)."""
    if not _main() or _Held.depth == 0:
        yield
        return
    signal.signal(signal.SIGINT, _Held.previous)
    try:
        _deliver()
        yield
    finally:
        signal.signal(signal.SIGINT, _note)


def _deliver() -> None:
    if _Held.arrived:
        first, _Held.arrived = _Held.arrived[0], []
        _Held.previous(*first)  # Python's own handler raises KeyboardInterrupt here
