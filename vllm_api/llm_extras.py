"""vLLM's ``LLM`` methods that scripts touch beyond generating (profiling, metrics, the
methods of features this engine lacks), as a mixin ``engine.LLM`` (and ``LLMEngine``)
inherit, so engine.py keeps only the engine's own work. It needs only ``stats()``,
``config``, ``model`` and ``scheduler`` (``running`` / ``waiting``) of its host, so
``LLM`` and ``LLMEngine`` can both inherit it.

Profiling: ``start_profile()`` / ``stop_profile()`` run ``torch.profiler`` around whatever the
engine does in between and write a Chrome trace (``*.pt.trace.json``, open it in Perfetto or
chrome://tracing) to a directory: the ``profile_dir`` argument, else
``ProfilerConfig(torch_profiler_dir=...)`` given as ``LLM(..., profiler_config=...)``, else the
``VLLM_TORCH_PROFILER_DIR`` environment variable (vLLM's), else ``./vllm_profile``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from vllm_api.errors import refuse
from vllm_api.refusals import Refusing
from vllm_api.metrics import Metric, metrics_from_stats
from vllm_api.worker import run_on_worker

PROFILE_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
DEFAULT_PROFILE_DIR = "vllm_profile"
WEIGHT_UPDATE_REASON = ("vLLM's weight-transfer engine (NCCL, a second process) has no peer here: "
                        "change the one worker's weights in place, by model.load_weights through "
                        "apply_model, or by a worker extension through collective_rpc, then "
                        "reset_prefix_cache()")
SLEEP_REASON = "weights and KV cache always stay in memory (enable_sleep_mode is refused)"


def check_sleep_level(level: int) -> None:
    """Level 0 (pause scheduling) is served; 1 and 2 free memory, which this engine never does."""
    if level != 0:
        refuse("sleep mode", f"sleep(level={level}): {SLEEP_REASON}; sleep(level=0) pauses "
                             f"scheduling")


class LLMExtras(Refusing):
    """Mixed into ``engine.LLM``; uses its ``stats()``, ``config``, ``model`` and
    ``scheduler`` and nothing of the step loop."""

    _profiler = None

    # ------------------------------------------------------------------ profiling

    def start_profile(self, profile_prefix: str | None = None, profile_dir: str | None = None, *,
                      delay_iterations: int = 0, max_iterations: int = 0) -> None:
        """Start recording a torch.profiler trace (CPU, and CUDA when on a GPU)."""
        import torch

        if delay_iterations or max_iterations:
            refuse("profiling windows (delay_iterations / max_iterations)", "the profile runs "
                   "from start_profile() to stop_profile()")
        if self._profiler is not None:
            raise RuntimeError("a profile is already running: call stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        directory = Path(profile_dir or self._profile_dir())
        directory.mkdir(parents=True, exist_ok=True)
        self._profile_target = directory / f"{profile_prefix or 'llm'}_{os.getpid()}_" \
                                           f"{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json"
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def stop_profile(self) -> str:
        """Stop recording and write the trace; returns its path."""
        if self._profiler is None:
            raise RuntimeError("no profile is running: call start_profile() first")
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(self._profile_target))
        return str(self._profile_target)

    def _profile_dir(self) -> str:
        config = getattr(self.config, "profiler_config", None)
        configured = (config.get("torch_profiler_dir") if hasattr(config, "get")
                      else getattr(config, "torch_profiler_dir", None))
        return configured or os.environ.get(PROFILE_DIR_ENV) or DEFAULT_PROFILE_DIR

    # ------------------------------------------------------------------ metrics

    def get_metrics(self) -> list[Metric]:
        """vLLM-shaped Counter / Gauge metrics (``vllm:prefix_cache_hits``, ...)."""
        stats = self.stats()
        return metrics_from_stats(stats, len(self.scheduler.running), len(self.scheduler.waiting),
                                  str(self.model_path))

    # ------------------------------------------------------------------ the rest of vLLM's LLM

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def apply_model(self, func) -> list:
        """vLLM's ``apply_model``: ``func(model)`` on each worker; here one model, one result,
        between steps (under the engine's lock)."""
        engine = getattr(self, "llm_engine", self)
        with engine.engine_core.lock:
            return [func(self.model)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        """vLLM's ``collective_rpc`` on the one in-process worker (worker.py): ``method`` is a
        callable taking the worker first (``self.rank``, ``self.model_runner``...), or the
        name of a worker method."""
        engine = getattr(self, "llm_engine", self)
        with engine.engine_core.lock:  # between steps: a step never sees half-changed weights
            return run_on_worker(engine.worker, method, args, kwargs)

    def reset_mm_cache(self) -> None:
        """Nothing to reset: no multimodal inputs."""

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's pause: ``sleep(level=0)`` stops scheduling (requests are still accepted,
        ``step()`` runs nothing) until ``wake_up(tags=["scheduling"])``; ``mode`` "abort"
        aborts the requests in the engine, "keep" keeps them. A ``step()`` under way in another
        thread finishes first. Deeper levels free memory this engine never frees, and are
        refused."""
        check_sleep_level(level)
        if mode not in ("abort", "keep"):
            refuse(f"sleep(mode={mode!r}) on the offline engine",
                   "its steps run in the caller's thread: finish the requests with step() "
                   "first, or use mode='keep'")
        engine = getattr(self, "llm_engine", self)
        with engine.engine_core.lock:  # between steps (re-entrant: a hook inside a step may call)
            if mode == "abort":
                engine.abort_request(list(engine.engine_core.output_processor.requests))
            engine.paused = True

    def wake_up(self, tags=None) -> bool:
        """Resume scheduling (``tags`` None or naming "scheduling"); True: fully awake."""
        if tags is None or "scheduling" in tags:
            getattr(self, "llm_engine", self).paused = False
        return True

    def is_sleeping(self) -> bool:
        return getattr(self, "llm_engine", self).paused

    def do_log_stats(self, *args, **kwargs) -> None:
        """The engine logs no statistics; ``get_metrics()`` has them."""

    do_log_stats_with_interval = do_log_stats

    def has_unfinished_requests_dp(self, has_unfinished: bool | None = None) -> bool:
        """One data-parallel rank: the same as ``has_unfinished_requests()``."""
        return self.has_unfinished_requests()

    def get_world_size(self, include_dp: bool = True) -> int:
        return 1  # one process, one device

    @classmethod
    def from_engine_args(cls, engine_args, **_ignored):
        """Build from an ``EngineArgs`` (vLLM's ``LLM.from_engine_args``)."""
        return cls(engine_args.model, **engine_args.kwargs)

    def reset_encoder_cache(self) -> None:
        """Nothing to reset: decoder-only models."""

    def list_loras(self) -> set[int]:
        return set()  # no adapters are ever loaded

    def add_lora(self, lora_request) -> bool:
        refuse("LoRA adapters", "the engine loads base weights only")

    def remove_lora(self, lora_id: int) -> bool:
        refuse("LoRA adapters", "the engine loads base weights only")

    pin_lora = remove_lora

    def update_weights(self, *args, **kwargs):
        refuse("weight-transfer updates", WEIGHT_UPDATE_REASON)

    (start_weight_update, finish_weight_update, start_draft_weight_update,
     init_weight_transfer_engine, shutdown_weight_transfer_engine, release_kv_cache_memory,
     update_weight_version, get_weight_version, set_weight_version) = (update_weights,) * 9

    def reward(self, *args, **kwargs):
        refuse("pooling", "reward models are pooling models; the engine runs generative "
                          "models only")
