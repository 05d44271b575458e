"""The one worker ``collective_rpc`` and ``apply_model`` reach: what vLLM's worker object shows
a function it runs there (``self.rank``, ``self.device``, ``self.model_runner.model``, ...).

vLLM runs ``collective_rpc(fn)`` as ``fn(worker, *args, **kwargs)`` on every worker process
and ``collective_rpc("name")`` as the worker's method ``name``; this engine has one worker,
in-process, so the result is a one-element list. Its ``model_runner`` is the core's
``ModelRunner`` (``.model`` is the loaded ``CausalLM``, the very model every path runs).

``LLM(..., worker_extension_cls="module.Class")`` mixes a user class into the worker, as vLLM
does (RL frameworks put their weight-sync methods there): ``collective_rpc("its_method", ...)``
then runs it with ``self.model_runner.model`` in reach. Its names may not shadow the worker's.
"""
from __future__ import annotations

import importlib


class Worker:
    """Rank 0 of a world of one, on the engine's device."""

    rank = 0
    local_rank = 0
    world_size = 1
    is_driver_worker = True

    def __init__(self, llm_engine) -> None:
        self.llm_engine = llm_engine

    @property
    def device(self):
        return self.llm_engine.device

    @property
    def model_runner(self):
        return self.llm_engine.engine_core.model_runner

    @property
    def model_config(self):
        return self.llm_engine.model_config

    @property
    def vllm_config(self):
        return self.llm_engine.config

    def get_model(self):
        return self.model_runner.model

    def apply_model(self, fn):
        return fn(self.get_model())

    def check_health(self) -> None:
        """Alive as long as the process is."""

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()


def worker_class(extension=None) -> type[Worker]:
    """``Worker``, or ``Worker`` with ``extension`` (a class, or its "module.Class" name) as a
    further base; an extension attribute that the worker already has is refused (vLLM's rule)."""
    if extension is None:
        return Worker
    cls = _import_class(extension) if isinstance(extension, str) else extension
    if not isinstance(cls, type):
        raise TypeError(f"worker_extension_cls must be a class or a 'module.Class' name, got {extension!r}")
    clashes = [name for name in vars(cls) if not name.startswith("__") and hasattr(Worker, name)]
    if clashes:
        raise ValueError(f"Worker class {Worker} already has an attribute {clashes[0]}, which "
                         f"conflicts with the worker extension class {cls}.")
    return type(f"Worker_{cls.__name__}", (Worker, cls), {})


def _import_class(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    if not module:
        raise ValueError(f"worker_extension_cls {qualname!r} is not a 'module.Class' name")
    return getattr(importlib.import_module(module), name)


def run_on_worker(worker: Worker, method, args=(), kwargs=None) -> list:
    """vLLM's ``collective_rpc`` semantics on the one worker."""
    if isinstance(method, str):
        target = getattr(worker, method, None)
        if target is None:
            raise AttributeError(f"the worker has no method {method!r} (collective_rpc calls a "
                                 f"worker method by name, or a callable with the worker first)")
        return [target(*args, **(kwargs or {}))]
    return [method(worker, *args, **(kwargs or {}))]
