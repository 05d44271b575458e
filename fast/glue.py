"""A layer's glue by the compiled kernels: the fast layer's RMSNorm and heads' norm + RoPE.

Between its linears a layer normalises its hidden rows twice and, in attention, normalises
(Qwen3) and rotates each query and key head: model.py does each with several small PyTorch
ops, which at a decode step of one sequence cost more than the arithmetic. Through model.py's
backend seam, ``KernelRMSNorm`` computes a norm part and ``KernelRotation`` a rotation part (the
head norm and RoPE in one call per projection), each from the user's module's own weight and
eps on every call. A rotation whose head norm carries forward hooks (or computes something of
its own) is left to model.py, so the hooks fire. Same rounding as model.py's.
"""
from __future__ import annotations

import torch
from torch import nn

from fast.linear import has_hooks
from model import HeadRotation, RMSNorm


class KernelRMSNorm:
    """model.RMSNorm by the compiled kernel (rows of the last dimension)."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def __call__(self, part: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if not kernel_weight(part.weight, x):
            return part.compute(x)
        return self.kernels.rms_norm(x, part.weight, part.eps)


class KernelRotation:
    """model.HeadRotation: each head normed by ``norm`` (its weight and eps; None: no norm) and
    rotated, in one kernel call."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def __call__(self, part: HeadRotation, x: torch.Tensor, norm: RMSNorm | None, rope) -> torch.Tensor:
        if norm is not None and (has_hooks(norm) or not norm.computes_as_declared()
                                 or not kernel_weight(norm.weight, x)):
            return part.compute(x, norm, rope)
        cos, sin = rope[0][:, 0], rope[1][:, 0]  # [T, D] (both halves), [T, D/2]
        weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        return self.kernels.norm_rope(x, weight, eps, cos, sin)


def kernel_weight(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """The kernels take a contiguous weight of x's dtype (a user's edit may give another)."""
    return weight.dtype == x.dtype and weight.is_contiguous()


def glue_replacements(model: nn.Module, kernels) -> dict:
    """A replacement per norm and rotation part of ``model`` (part name -> callable)."""
    norm, rotation = KernelRMSNorm(kernels), KernelRotation(kernels)
    return {name: norm if part.kind == "norm" else rotation
            for name, part in model.replaceable_parts() if part.kind in ("norm", "rotation")}
