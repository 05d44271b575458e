"""The fast layer's backend: the core's ``Backend`` seam with faster machinery behind it.

* attention: the kinds of fast/attention.py, planned once per step (``FastAttention``);
* linears: a packed copy of the model's tree (fast/linear.py) where oneDNN computes the
  dtype natively on this CPU; the model itself stays model.py's;
* the KV pool on huge pages (fast/cpu_memory.py);
* before each step, the CPU tuning's thread check (fast/tuning.py), when an entry point gave one;
* with ``kernels``, the compiled C++ kernels (fast/kernels.py) on CPU: decode attention,
  prompt-chunk attention (float32, float16), a layer's norms and RoPE (fast/glue.py), and in
  bfloat16 the linears of a decode step of a few sequences; without a compiler, the
  PyTorch kinds and oneDNN, and ``describe()`` says why.

Every part is tested equal to the plain path (tests/test_plain_path.py, test_attention_kinds.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from core.backend import Backend
from fast.attention import FastAttention, FastPlan, Routes
from fast.cpu_memory import zeros_on_huge_pages
from fast.glue import glue_copy
from fast.kernels import compiled_kernels
from fast.linear import onednn_linears_usable, packed_copy
from fast.tuning import CpuTuning
from model import CausalLM, SeqChunk


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FastBackend(Backend):
    name = "fast"

    def __init__(self, model: CausalLM, tuning: CpuTuning | None = None,
                 routes: Routes | None = None, pack_linears: bool | None = None,
                 kernels: bool = False) -> None:
        super().__init__(model)
        cfg = model.config
        routes = routes or Routes.probe(model.device, model.dtype)
        # The kernel's softmax is float32: a float64 model keeps the PyTorch kinds.
        usable = model.device.type == "cpu" and model.dtype in KERNEL_DTYPES
        self.kernels = compiled_kernels() if kernels and usable else None
        module = self.kernels.module if self.kernels is not None else None
        if module is not None:
            routes = replace(routes, decode_kernel=module.decode_attention)
        # Prompt chunks too, where the tiled bfloat16 matmuls are not faster (float32, float16).
        if module is not None and not routes.matmul_attention and module.prefill_attention_available():
            routes = replace(routes, prefill_kernel=module.prefill_attention)
        if module is not None and module.prefill_attention_available():
            routes = replace(routes, shared_decode_kernel=module.shared_decode_attention)
        # Decode steps of a few sequences in bfloat16 stream the weights by the compiled linear.
        small = (module.small_linear if module is not None and model.dtype == torch.bfloat16
                 and module.small_linear_available() else None)
        self.attention = FastAttention(set(cfg.layer_windows), cfg.num_heads // cfg.num_kv_heads,
                                       model.dtype, model.device, routes)
        if pack_linears is None:
            pack_linears = onednn_linears_usable(model.device, model.dtype)
        self.pack_linears = pack_linears
        self.runs = packed_copy(model, small) if pack_linears else model
        if module is not None:  # norms and RoPE: one kernel call each instead of several ops
            self.runs = glue_copy(self.runs, module)
        self.tuning = tuning

    def plan(self, chunks: list[SeqChunk], block_size: int) -> FastPlan:
        return self.attention.plan(chunks, block_size)

    def forward(self, input_ids: torch.Tensor, plan: FastPlan, kv,
                logits_index: torch.Tensor) -> torch.Tensor:
        return self.runs(input_ids, plan, kv, logits_index)

    def kv_zeros(self, shape: tuple[int, ...], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return zeros_on_huge_pages(shape, dtype, device)

    def before_step(self) -> None:
        if self.tuning is not None:
            self.tuning.maybe_update()

    def describe(self) -> str:
        parts = ["fast attention", "packed linears" if self.pack_linears else "plain linears"]
        if self.kernels is not None:
            parts.append(self.kernels.describe())
        if self.tuning is not None:
            parts.append(self.tuning.describe())
        return f"{self.name} ({', '.join(parts)})"
