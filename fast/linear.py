"""Linear layers run from oneDNN-packed weights: the fast layer's linears.

On CPU, oneDNN's kernels on a weight reordered once into their blocked layout beat MKL's
sgemm in float32, and the unpacked matmul in bfloat16 where the CPU computes it natively
(a [1, 1024] x [1024, 151936] LM head 14.6 -> 3.9 ms), most at decode batch sizes. The ops
are the ones torch.compile's CPU backend emits (``torch.ops.mkldnn``); where they are
missing or wrong, nothing is packed and the model's linears compute as model.py's. The
packed weights cost a second copy of the weights in RAM: the dense one stays the parameter, so
weight names, loading and edits are unchanged.

Through model.py's backend seam, ``PackedLinear`` computes one linear part and ``PackedSiluMLP``
one SiLU MLP (its gate and up GEMMs apply SiLU and the product in their epilogues: no extra
passes over the [tokens, 2 x intermediate] activations). Each is called with the user's own
module and reads its parameters on every call; the packed copy is derived from them and
re-packed whenever the weight is another tensor, another storage, or its version counter moved
(``Packed``). An MLP whose gate/up linear carries forward hooks is computed by model.py's own
MLP (its linears still packed), so the hooks fire.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fast.decode_layer import LINEAR_BF16
from model import MLP, Linear


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


def few_rows(x: torch.Tensor, small: Callable | None, weight: torch.Tensor) -> bool:
    """Whether ``small`` (the compiled few-row linear) computes this input: a decode step of at
    most SMALL_ROWS sequences, on a contiguous bfloat16 weight."""
    return (small is not None and x.dim() == 2 and x.shape[0] <= SMALL_ROWS
            and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and weight.is_contiguous())


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run hooks (its own or global forward hooks)."""
    hooks = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks
                or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


class Packed:
    """oneDNN-packed pieces of one weight, kept in step with it: re-packed when the parameter is
    another tensor, another storage, or its version counter moved since they were packed."""

    def __init__(self, pieces: int = 1) -> None:
        self.pieces, self.key, self.packed = pieces, None, ()

    def of(self, weight: torch.Tensor) -> tuple:
        key = (weight, weight.data_ptr(), weight._version)
        held = self.key
        if held is None or held[0] is not weight or held[1] != key[1] or held[2] != key[2]:
            self.packed = tuple(pack(w) for w in weight.detach().chunk(self.pieces))
            self.key = key
        return self.packed


class PackedLinear:
    """A linear part's math from its packed weight; a few rows by ``small`` (fast/kernels.py's
    bfloat16 few-row linear) from the dense weight, where given."""

    def __init__(self, small: Callable | None = None) -> None:
        self.small, self.weight = small, Packed()

    def __call__(self, part: Linear, x: torch.Tensor) -> torch.Tensor:
        weight, bias = part.weight, part.bias
        if few_rows(x, self.small, weight):
            return self.small(x, weight, bias, False)
        packed, = self.weight.of(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def decode_kind(self, part: Linear, x: torch.Tensor) -> int | None:
        """The kernel fast/decode_layer.py calls for ``x``, where it is the few-row one."""
        return LINEAR_BF16 if few_rows(x, self.small, part.weight) else None


class PackedSiluMLP:
    """model.MLP with SiLU: gate and up as two packed GEMMs, the first with a SiLU epilogue,
    the second multiplying by it in its epilogue; then the part's own down projection."""

    def __init__(self, small: Callable | None = None) -> None:
        self.small, self.gate_up = small, Packed(pieces=2)

    def __call__(self, part: MLP, x: torch.Tensor) -> torch.Tensor:
        linear = part.gate_up_proj
        if part.hidden_act != "silu" or has_hooks(linear) or not linear.computes_as_declared():
            return part.compute(x)
        weight, bias = linear.weight, linear.bias
        if few_rows(x, self.small, weight):
            return part.down_proj(self.small(x, weight, bias, True))
        gate_w, up_w = self.gate_up.of(weight)
        gate_b, up_b = bias.detach().chunk(2) if bias is not None else (None, None)
        gate = torch.ops.mkldnn._linear_pointwise(x, gate_w, gate_b, "swish", [], "")
        both = torch.ops.mkldnn._linear_pointwise.binary(x, gate, up_w, up_b, "mul")
        return part.down_proj(both)

    def decode_kind(self, part: MLP, x: torch.Tensor) -> int | None:
        """The gate/up kernel fast/decode_layer.py calls for ``x`` (silu(gate) * up in it)."""
        linear = part.gate_up_proj
        if part.hidden_act != "silu" or has_hooks(linear) or not linear.computes_as_declared():
            return None
        return LINEAR_BF16 if few_rows(x, self.small, linear.weight) else None


def packed_replacements(model: nn.Module, small: Callable | None = None) -> dict:
    """A replacement per linear part and per SiLU MLP of ``model`` (part name -> callable)."""
    out = {}
    for name, part in model.replaceable_parts():
        if part.kind == "linear":
            out[name] = PackedLinear(small)
        elif part.kind == "mlp" and part.hidden_act == "silu" and part.gate_up_proj.kind == "linear":
            out[name] = PackedSiluMLP(small)
    return out
