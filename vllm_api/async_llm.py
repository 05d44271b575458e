"""vLLM's ``AsyncLLM`` (``AsyncLLMEngine`` is the same class, as in vLLM 0.32): an asyncio
front end on the thread-safe engine, what servers, async clients and RL rollouts build on.

``async for output in engine.generate(prompt, params, request_id)`` streams the request's
``RequestOutput``s (per ``params.output_kind``: CUMULATIVE by default, DELTA, or FINAL_ONLY)
until it finishes. One background thread (step_loop.py) steps the engine while any request is
unfinished and sleeps otherwise. Leaving the ``async for`` early -- a ``break``, a cancelled
task, a disconnected client -- aborts the request, so its blocks return at once (cached ones
stay reusable). ``pause_generation`` / ``resume_generation`` hold new requests at the door
(mode "abort" aborts those running, "keep" freezes them, "wait" lets them finish) and stop
the step loop; pause returns only once no step runs and the outputs of the steps before
have reached their streams. ``sleep(level=0)`` / ``wake_up(["scheduling"])`` are the same
pause, as in vLLM.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref

from vllm_api.member_refusals import ASYNC_REFUSED
from vllm_api.errors import EngineDeadError, VLLMValidationError
from vllm_api.intake import reject_unsupported
from vllm_api.llm_engine import LLMEngine
from vllm_api.llm_extras import check_sleep_level
from vllm_api.refusals import Refusing, refuses
from vllm_api.step_loop import StepLoop

PAUSE_MODES = ("abort", "wait", "keep")


@refuses("AsyncLLM", ASYNC_REFUSED)
class AsyncLLM(Refusing):
    """``AsyncLLM(model, **engine_args)``, or ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))``."""

    log_requests = False  # the engine logs no requests and no statistics
    log_stats = False
    logger_manager = None
    output_handler = None  # outputs cross on the stepping thread, not an asyncio task
    profiler = None
    admission_stats = None

    def __init__(self, model: str | os.PathLike, **engine_args) -> None:
        self.llm_engine = LLMEngine(model, **engine_args)  # worker_extension_cls too
        self._steps = StepLoop(self.llm_engine)
        self._gate = threading.Lock()
        self._paused = False
        self._held: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        weakref.finalize(self, self._steps.stop)  # dropped without shutdown(): the thread ends

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers=None) -> "AsyncLLM":
        return cls(engine_args.model, **engine_args.kwargs)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt, sampling_params, request_id: str, *, prompt_text=None,
                       lora_request=None, tokenization_kwargs=None, trace_headers=None,
                       priority: int = 0, data_parallel_rank: int | None = None,
                       **unsupported):
        """Stream one request's outputs; leaving early aborts it."""
        reject_unsupported(lora_request, tokenization_kwargs=tokenization_kwargs, **unsupported)
        check_data_parallel_rank(data_parallel_rank)
        self._check_alive()
        await self._wait_while_paused()
        queue: asyncio.Queue = asyncio.Queue()
        sink = self._steps.sink(asyncio.get_running_loop(), queue)
        state, = self.llm_engine.add_requests([(prompt, sampling_params)], sink=sink,
                                              request_ids=[request_id], priorities=[priority])
        self._steps.started(state.request_id, sink)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._steps.sinks.pop(state.request_id, None)
            if self._steps.dead is None:
                self.llm_engine.abort(state.request_id)  # no-op once finished

    async def abort(self, request_id, internal: bool = False) -> None:
        """Abort one request id or several; their streams end with the aborted output."""
        self.llm_engine.abort_request(request_id)

    # ------------------------------------------------------------------ pause and resume

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Hold new requests until ``resume_generation()``; ``mode`` says what happens to the
        running ones: "abort" them, "keep" them frozen, or "wait" until they finish. Returns
        once no step runs (none starts until the resume) and every output of the steps before
        is in its stream's queue (a stream on another event loop: sent to that loop)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        self._check_alive()
        with self._gate:
            self._paused = True
        if mode == "abort":
            self.llm_engine.abort_request(list(self._steps.sinks))
        if threading.current_thread() is self._steps.thread:  # a hook inside a step: waiting
            self._steps.set_frozen(True)                      # for that step would never end
        else:  # off the event loop; done only after the outputs it waited for, on this loop
            await asyncio.to_thread(self._steps.pause, mode == "wait")
        self._check_alive()
        if clear_cache:
            self.llm_engine.reset_prefix_cache()

    async def resume_generation(self) -> None:
        with self._gate:
            self._paused, held = False, self._held
            self._held = []
        self._steps.set_frozen(False)
        for loop, future in held:
            _release(loop, future)

    async def is_paused(self) -> bool:
        return self._paused

    async def _wait_while_paused(self) -> None:
        while self._paused:
            future = asyncio.get_running_loop().create_future()
            with self._gate:
                if not self._paused:
                    return
                self._held.append((asyncio.get_running_loop(), future))
            await future

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Level 0 pauses scheduling (``pause_generation(mode=mode)``); deeper levels free
        memory this engine never frees, and are refused."""
        check_sleep_level(level)
        await self.pause_generation(mode=mode, clear_cache=False)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is None or "scheduling" in tags:
            await self.resume_generation()
        return True

    async def is_sleeping(self) -> bool:
        return self._paused

    async def wait_for_requests_to_drain(self, drain_timeout: int = 300) -> None:
        if not await asyncio.to_thread(self._steps.wait_idle, drain_timeout):
            raise TimeoutError(f"Timeout reached after {drain_timeout} seconds waiting for "
                               f"requests to drain.")

    # ------------------------------------------------------------------ life and death

    def _check_alive(self) -> None:
        if self._steps.dead is not None:
            raise self._steps.dead
        if self._steps.stopped:
            raise RuntimeError("AsyncLLM is shut down")

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the stepping thread, abort what runs."""
        self._steps.stop()
        self._steps.thread.join(timeout)
        self.llm_engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._steps.thread.is_alive() and self._steps.dead is None

    @property
    def is_stopped(self) -> bool:
        return self._steps.stopped

    @property
    def errored(self) -> bool:
        """A step has failed, or the stepping thread is gone (vLLM: dead, or not running)."""
        return self._steps.dead is not None or not self._steps.thread.is_alive()

    @property
    def dead_error(self) -> BaseException:
        """The ``EngineDeadError`` every caller gets (carrying the failed step's error)."""
        return self._steps.dead or EngineDeadError()

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` while the engine is ``errored``, as vLLM's does."""
        if self.errored:
            raise self.dead_error

    # ------------------------------------------------------------------ the engine's parts

    @property
    def engine_core(self):
        return self.llm_engine.engine_core

    @property
    def output_processor(self):
        return self.llm_engine.output_processor

    @property
    def model_config(self):
        return self.llm_engine.model_config

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return self.llm_engine.get_num_unfinished_requests()

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """No admission limits here: every request is queued."""

    def get_kv_event_sources(self) -> dict:
        config = self.llm_engine.config.kv_events_config
        return {0: config} if self.llm_engine.kv_events is not None else {}

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None):
        """vLLM's ``collective_rpc`` on the one in-process worker (LLMEngine's)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    async def reset_mm_cache(self) -> None:
        """Nothing to reset: no multimodal inputs."""

    async def reset_encoder_cache(self) -> None:
        """Nothing to reset: decoder-only models."""

    async def start_profile(self, profile_prefix: str | None = None, *, delay_iterations=0,
                            max_iterations=0) -> None:
        self.llm_engine.start_profile(profile_prefix)

    async def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    async def list_loras(self) -> set[int]:
        return set()  # no adapters are ever loaded

    async def do_log_stats(self) -> None:
        """The engine logs no statistics; ``llm_engine.get_metrics()`` has them."""

    async def is_tracing_enabled(self) -> bool:
        return False


def check_data_parallel_rank(rank: int | None) -> None:
    """One engine: rank None or 0, else vLLM's validation error."""
    if rank is not None and rank != 0:
        raise VLLMValidationError(f"data_parallel_rank {rank} is out of range [0, 1).",
                                  parameter="data_parallel_rank", value=rank)


def _release(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
    def wake() -> None:
        if not future.done():
            future.set_result(None)
    try:
        loop.call_soon_threadsafe(wake)
    except RuntimeError:  # that client's loop has closed: nobody waits
        pass


AsyncLLMEngine = AsyncLLM  # vLLM 0.32: the same class under its old name
