"""vLLM's ``AsyncLLM`` (``AsyncLLMEngine`` is the same class, as in vLLM 0.32): an asyncio
front end on the thread-safe engine, what servers and async clients build on.

``async for output in engine.generate(prompt, params, request_id)`` streams the request's
``RequestOutput``s (per ``params.output_kind``: CUMULATIVE by default, DELTA, or FINAL_ONLY)
until it finishes. One background thread steps the engine while any request is unfinished
and sleeps otherwise; each request's outputs cross to the caller's event loop through its own
queue. Leaving the ``async for`` early -- a ``break``, a cancelled task, a disconnected client
-- aborts the request, so its blocks return at once (cached ones stay reusable).
"""
from __future__ import annotations

import asyncio
import os
import threading

from core.requests import OutputSink
from vllm_api.intake import reject_unsupported
from vllm_api.llm_engine import LLMEngine


class QueueSink(OutputSink):
    """One request's outputs, handed to an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        super().__init__(takes_aborted=True)  # an abort() from elsewhere ends the stream too
        self.loop, self.queue = loop, queue

    def put(self, output) -> None:
        super().put(output)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)

    def fail(self, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, error)


class AsyncLLM:
    """``AsyncLLM(model, **engine_args)``, or ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))``."""

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        self.llm_engine = LLMEngine(model, **engine_args)
        self._sinks: dict[str, QueueSink] = {}
        self._wake = threading.Condition()
        self._dead: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="async-llm-steps", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop: bool = True, **_ignored) -> "AsyncLLM":
        return cls(engine_args.model, **engine_args.kwargs)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt, sampling_params, request_id: str, *, prompt_text=None,
                       lora_request=None, priority: int = 0, **unsupported):
        """Stream one request's outputs; leaving early aborts it."""
        reject_unsupported(lora_request, priority, **unsupported)
        self._check_alive()
        queue: asyncio.Queue = asyncio.Queue()
        sink = QueueSink(asyncio.get_running_loop(), queue)
        state, = self.llm_engine.add_requests([(prompt, sampling_params)], sink=sink,
                                              request_ids=[request_id])
        self._started(state.request_id, sink)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._sinks.pop(state.request_id, None)
            self.llm_engine.abort(state.request_id)  # no-op once finished

    def _started(self, request_id: str, sink: QueueSink) -> None:
        with self._wake:
            self._sinks[request_id] = sink
            self._wake.notify()

    async def abort(self, request_id, internal: bool = False) -> None:
        """Abort one request id or several; their streams end with the aborted output."""
        self.llm_engine.abort_request(request_id)

    # ------------------------------------------------------------------ the stepping thread

    def _run(self) -> None:
        while self._wait_for_work():
            try:
                self.llm_engine.step()
            except Exception as exc:  # noqa: BLE001 -- every waiting stream must hear of it
                self._die(exc)
                return

    def _wait_for_work(self) -> bool:
        with self._wake:
            while not self._stopped and not self.llm_engine.has_unfinished_requests():
                self._wake.wait()
            return not self._stopped

    def _die(self, exc: Exception) -> None:
        self._dead = RuntimeError(f"the engine failed in a step and stopped: {exc!r}")
        self._dead.__cause__ = exc
        for sink in list(self._sinks.values()):
            sink.fail(self._dead)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what runs, stop the stepping thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)
        self.llm_engine.shutdown()

    # ------------------------------------------------------------------ vLLM's accessors

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def check_health(self) -> None:
        self._check_alive()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return self.llm_engine.get_num_unfinished_requests()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, *_args) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    async def do_log_stats(self) -> None:
        """The engine logs no statistics; ``llm_engine.get_metrics()`` has them."""

    async def is_tracing_enabled(self) -> bool:
        return False

    def __del__(self) -> None:
        if not getattr(self, "_stopped", True):
            with self._wake:
                self._stopped = True
                self._wake.notify()


AsyncLLMEngine = AsyncLLM  # vLLM 0.32: the same class under its old name
