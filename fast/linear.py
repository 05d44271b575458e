"""Linear layers run from oneDNN-packed weights: the fast layer's linears.

On CPU, oneDNN's kernels on a weight reordered once into their blocked layout beat MKL's
sgemm in float32, and the unpacked matmul in bfloat16 where the CPU computes it natively
(a [1, 1024] x [1024, 151936] LM head 14.6 -> 3.9 ms), most at decode batch sizes. The ops
are the ones torch.compile's CPU backend emits (``torch.ops.mkldnn``); where they are
missing or wrong, nothing is packed and the model keeps its plain ``nn.Linear`` layers. The
packed copy costs a second copy of the weights in RAM: the dense one stays the parameter, so
weight names and loading are unchanged.

``packed_copy(model)`` builds a second module tree over the same parameters in which every
``nn.Linear`` is a ``PackedLinear`` and every SiLU MLP a ``PackedSiluMLP`` (whose gate and up
GEMMs apply SiLU and the product in their epilogues: no extra passes over the
[tokens, 2 x intermediate] activations). The model itself is left exactly as model.py built it.
"""
from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_linears_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU; float32, or bfloat16 / float16 where the CPU computes them natively (oneDNN's
    check: AVX-512 BF16, AMX); and a torch build that has the ops and gets a small product
    right with them."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or not native_low_precision(dtype):
        return False
    try:
        weight = torch.linspace(-1, 1, 32).view(4, 8).to(dtype)
        x = torch.linspace(0, 1, 16).view(2, 8).to(dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, pack(weight), None, "none", [], "")
        return torch.allclose(got.float(), F.linear(x.float(), weight.float()), atol=2e-2)
    except (AttributeError, RuntimeError):
        return False


def native_low_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` matmuls natively (float32 always)."""
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return hasattr(mkldnn, "_is_mkldnn_fp16_supported") and mkldnn._is_mkldnn_fp16_supported()
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered into oneDNN's layout (a copy: later edits of ``weight`` are not seen)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


SMALL_ROWS = 4  # the most rows fast/csrc/small_linear.cpp takes


def few_rows(x: torch.Tensor, small: Callable | None) -> bool:
    """Whether ``small`` (the compiled few-row linear) computes this input: a decode step of at
    most SMALL_ROWS sequences."""
    return small is not None and x.dim() == 2 and x.shape[0] <= SMALL_ROWS


class PackedLinear(nn.Module):
    """An nn.Linear's weight and bias, computed from the packed copy; a few rows by ``small``
    (fast/kernels.py's bfloat16 few-row linear) from the dense weight, where given."""

    def __init__(self, dense: nn.Linear, small: Callable | None = None) -> None:
        super().__init__()
        self.weight, self.bias = dense.weight, dense.bias
        self.packed = pack(dense.weight)
        self.small = small if dense.weight.is_contiguous() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if few_rows(x, self.small):
            return self.small(x, self.weight, self.bias, False)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedSiluMLP(nn.Module):
    """model.MLP with SiLU: gate and up as two packed GEMMs, the first with a SiLU epilogue,
    the second multiplying by it in its epilogue; then the packed down projection."""

    def __init__(self, mlp: nn.Module, small: Callable | None = None) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, PackedLinear(mlp.down_proj, small)
        self.small = small if mlp.gate_up_proj.weight.is_contiguous() else None
        weights = mlp.gate_up_proj.weight.chunk(2)
        bias = mlp.gate_up_proj.bias
        biases = bias.detach().chunk(2) if bias is not None else (None, None)
        (self.gate_w, self.gate_b), (self.up_w, self.up_b) = ((pack(w), b) for w, b in zip(weights, biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if few_rows(x, self.small):
            return self.down_proj(self.small(x, self.gate_up_proj.weight, self.gate_up_proj.bias, True))
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate_w, self.gate_b, "swish", [], "")
        both = torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up_w, self.up_b, "mul")
        return self.down_proj(both)


def packed_copy(module: nn.Module, small: Callable | None = None) -> nn.Module:
    """A copy of ``module``'s tree sharing its parameters and buffers, with each SiLU MLP (an
    ``hidden_act`` and a ``gate_up_proj``) as a PackedSiluMLP and every other nn.Linear as a
    PackedLinear (``small``: the few-row linear they use for decode steps, if any); ``module``
    is unchanged."""
    if getattr(module, "hidden_act", None) == "silu" and hasattr(module, "gate_up_proj"):
        return PackedSiluMLP(module, small)
    if isinstance(module, nn.Linear):
        return PackedLinear(module, small)
    twin = copy.copy(module)  # shares the parameter and buffer dicts; children are replaced
    twin._modules = {name: packed_copy(child, small) for name, child in module._modules.items()}
    return twin
