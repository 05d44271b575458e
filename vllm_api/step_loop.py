"""The thread that steps an ``AsyncLLM``'s engine, and the queues that carry each request's
outputs to its client's event loop.

The thread holds the engine and the streams, never the ``AsyncLLM`` itself: an ``AsyncLLM``
dropped without ``shutdown()`` is collected, and its finalizer stops the thread, which lets go
of the engine (model, KV pool). One client whose event loop has closed loses its own stream
only: its request is aborted after the step. Anything a step raises -- an ``Exception`` or a
``BaseException`` such as ``SystemExit`` from a user's ``hash_fn`` -- marks the engine dead:
every stream, and every later call, gets ``EngineDeadError``.

``pause()`` is a handshake, not a flag: it freezes the loop, then blocks until the thread is
between steps. A step's outputs are sent (``call_soon_threadsafe``, in order) inside the step,
so by then they are on their way to every stream, and a stream on the pausing caller's own
event loop has them queued before that caller resumes.
"""
from __future__ import annotations

import asyncio
import threading

from core.requests import OutputSink
from vllm_api.errors import EngineDeadError


class QueueSink(OutputSink):
    """One request's outputs, handed to an asyncio queue on its client's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, on_lost) -> None:
        super().__init__(takes_aborted=True)  # an abort() from elsewhere ends the stream too
        self.loop, self.queue, self.on_lost = loop, queue, on_lost
        self.request_id: str | None = None

    def put(self, output) -> None:
        self.num_finished += output.finished  # kept nowhere else: the client's queue has it
        self.send(output)

    def fail(self, error: BaseException) -> None:
        self.send(error)

    def send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": nobody reads this stream any more
            if self.request_id is not None:
                self.on_lost(self.request_id)


class StepLoop:
    """Steps ``engine`` while any request is unfinished and the loop is not frozen."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.sinks: dict[str, QueueSink] = {}
        self.wake = threading.Condition()
        self.dead: EngineDeadError | None = None
        self.stopped = False
        self.frozen = False  # paused: requests stay, no step starts
        self.busy = False    # a step is under way, its outputs perhaps not all sent yet
        self.lost: list[str] = []
        self.thread = threading.Thread(target=self._run, name="async-llm-steps", daemon=True)
        self.thread.start()

    def sink(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> QueueSink:
        return QueueSink(loop, queue, self._lose)

    def started(self, request_id: str, sink: QueueSink) -> None:
        with self.wake:
            sink.request_id = request_id
            self.sinks[request_id] = sink
            self.wake.notify_all()

    def _lose(self, request_id: str) -> None:
        self.lost.append(request_id)  # called inside a step: aborted after it

    def _run(self) -> None:
        while self._wait_for_work():
            try:
                self.engine.step()
                self._abort_lost()
            except BaseException as exc:  # noqa: BLE001 -- every waiting stream must hear of it
                self._die(exc)
                return
            with self.wake:
                self.busy = False
                self.wake.notify_all()  # wake wait_idle() and pause()

    def _wait_for_work(self) -> bool:
        with self.wake:
            while not self.stopped and (self.frozen or not self.engine.has_unfinished_requests()):
                self.wake.notify_all()
                self.wake.wait()
            self.busy = not self.stopped  # decided under the lock: pause() sees it or stops it
            return self.busy

    def _abort_lost(self) -> None:
        lost, self.lost = self.lost, []
        for request_id in lost:
            self.sinks.pop(request_id, None)
            self.engine.abort(request_id)

    def _die(self, exc: BaseException) -> None:
        self.dead = EngineDeadError(exc)
        for sink in list(self.sinks.values()):
            sink.fail(self.dead)
        with self.wake:
            self.busy = False
            self.wake.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is unfinished (or the loop stopped); False on timeout."""
        with self.wake:
            return self.wake.wait_for(lambda: self.stopped or self.dead is not None
                                      or not self.engine.has_unfinished_requests(), timeout)

    def pause(self, drain: bool = False) -> None:
        """Freeze the loop; return once no step runs, so every output of the steps before is
        sent. ``drain``: first let the unfinished requests run to the end (frozen ones too).
        Blocks: call it off the event loop, and never from the step thread (it would wait for
        itself; ``set_frozen(True)`` there stops the loop after the current step)."""
        with self.wake:
            if drain:
                self.frozen = False
                self.wake.notify_all()
                self.wake.wait_for(lambda: self.stopped or self.dead is not None
                                   or not self.engine.has_unfinished_requests())
            self.frozen = True
            self.wake.notify_all()
            # not frozen: a resume came first, and the caller is no longer owed a pause
            self.wake.wait_for(lambda: not self.busy or not self.frozen or self.dead is not None)

    def set_frozen(self, frozen: bool) -> None:
        with self.wake:
            self.frozen = frozen
            self.wake.notify_all()

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify_all()
