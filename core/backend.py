"""The one seam between the core and the fast layer: how a step's math runs.

``Backend`` is the plain path -- model.py's ``PagedAttention``, its ``nn.Linear`` layers, a
KV pool of plain zeros -- and the spec every other backend is tested equal to. A faster one
(fast/backend.py) subclasses it and is handed to the engine core explicitly; nothing here
or in model.py chooses a path by itself.

Per step the model runner calls ``before_step()``, ``plan(chunks)`` once (the attention
backend: model.py's ``AttentionBackend`` protocol) and ``forward(...)`` once.
"""
from __future__ import annotations

import torch

from model import AttentionPlan, CausalLM, PagedAttention, SeqChunk


class Backend:
    name = "plain"

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.attention = PagedAttention(model.device)

    def plan(self, chunks: list[SeqChunk], block_size: int) -> AttentionPlan:
        return self.attention.plan(chunks, block_size)

    def forward(self, input_ids: torch.Tensor, plan: AttentionPlan, kv,
                logits_index: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, plan, kv, logits_index)

    def kv_zeros(self, shape: tuple[int, ...], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """Storage for the KV pool (block_manager.KVCachePool)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def before_step(self) -> None:
        """Called before every step's forward (the fast layer re-checks its thread count)."""

    def describe(self) -> str:
        return self.name
