"""The one seam between the core and the fast layer: how a step's math runs.

``Backend`` is the plain path -- model.py's ``PagedAttention``, its own linears, norms and RoPE,
a KV pool of plain zeros -- and the spec every other backend is tested equal to. A faster one
(fast/backend.py) subclasses it and is handed to the engine core explicitly; nothing here or in
model.py chooses a path by itself.

What a backend may change is exactly what model.py declares (its "backend seam"): the attention
plan, and a replacement per replaceable part (``replacements``: part name -> callable), which
``forward`` installs on the user's model itself -- no copy of the model exists, so an edit of
its weights, a ``load_weights`` and its forward hooks reach every path. Several engines may
share one model: each forward installs its backend's replacements under the model's lock.

Per step the model runner calls ``before_step()``, ``plan(chunks)`` once (the attention
backend: model.py's ``AttentionBackend`` protocol) and ``forward(...)`` once.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from model import AttentionPlan, CausalLM, FormatLinear, PagedAttention, SeqChunk

# model -> (its lock, [the token of the backend whose replacements are installed])
_INSTALLED: "weakref.WeakKeyDictionary[CausalLM, list]" = weakref.WeakKeyDictionary()
_INSTALLED_LOCK = threading.Lock()


class Backend:
    name = "plain"

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.attention = PagedAttention(model.device)
        self.replacements: dict[str, Callable] = {}  # model.py's own math everywhere
        self._lock, self._installed = _slot(model)
        self._token = object()  # names this backend in the slot without keeping it alive

    def rederive(self) -> None:
        """Derive again whatever this backend keeps from the weights (a write through
        ``param.data`` moves no version counter, so only this tells it); the plain path keeps
        nothing."""

    def plan(self, chunks: list[SeqChunk], block_size: int) -> AttentionPlan:
        return self.attention.plan(chunks, block_size)

    def forward(self, input_ids: torch.Tensor, plan: AttentionPlan, kv,
                logits_index: torch.Tensor) -> torch.Tensor:
        with self._lock:
            if self._installed[0] is not self._token:
                self.model.install(self.replacements)
                self._installed[0] = self._token
            return self.model(input_ids, plan, kv, logits_index)

    def kv_zeros(self, shape: tuple[int, ...], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """Storage for the KV pool (block_manager.KVCachePool)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def before_step(self) -> None:
        """Called before every step's forward (the fast layer re-checks its thread count)."""

    def described_linears(self) -> list[str]:
        """Each weight format's linears and what computes them for each row count (the kernels
        chosen per linear: its replacement's ``describe()``; else model.py's own math), as
        "int8 linears: 1-8 rows int8_linear, 9+ rows ... (57)"; none for a model without one."""
        groups: dict[str, int] = {}
        for name, part in self.model.replaceable_parts():
            if isinstance(part, FormatLinear):
                replacement = self.replacements.get(name)
                rows = (replacement.describe() if hasattr(replacement, "describe")
                        else f"any rows {part.weight_format.plain_kernel}")
                key = f"{part.weight_format.name} linears: {rows}"
                groups[key] = groups.get(key, 0) + 1
        return [f"{key} ({count})" for key, count in groups.items()]

    def describe(self) -> str:
        linears = self.described_linears()
        return f"{self.name} ({', '.join(linears)})" if linears else self.name


def _slot(model: CausalLM) -> tuple[threading.RLock, list]:
    """The model's lock and the one-element list naming the backend installed on it."""
    with _INSTALLED_LOCK:
        slot = _INSTALLED.get(model)
        if slot is None:
            slot = _INSTALLED[model] = (threading.RLock(), [None])
        return slot
