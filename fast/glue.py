"""A layer's glue by the compiled kernels: the fast layer's RMSNorm and RoPE.

Between its linears a layer normalises its hidden rows twice and, in attention, normalises
(Qwen3) and rotates each query and key head: model.py does each with several small PyTorch
ops, which at a decode step of one sequence cost more than the arithmetic. ``glue_copy(model,
kernels)`` builds a copy of the module tree in which every ``RMSNorm`` is a ``KernelRMSNorm``
and every ``Attention`` a ``KernelAttention`` (its head norms and RoPE in one call per
projection); the model itself is left as model.py built it. Same rounding as model.py's.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from model import Attention, RMSNorm, write_kv


class KernelRMSNorm(nn.Module):
    """model.RMSNorm by the compiled kernel (rows of the last dimension)."""

    def __init__(self, norm: RMSNorm, kernels) -> None:
        super().__init__()
        self.weight, self.eps, self.kernels = norm.weight, norm.eps, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class KernelAttention(nn.Module):
    """model.Attention with each head's norm and RoPE in one kernel call for q and one for k."""

    def __init__(self, attention: Attention, kernels) -> None:
        super().__init__()
        self.attention, self.kernels = attention, kernels

    def heads(self, x: torch.Tensor, count: int, norm: nn.Module | None, rope) -> torch.Tensor:
        """``count`` heads of x, normed by ``norm`` (its weight and eps; None: no norm), rotated."""
        cos, sin = rope[0][:, 0], rope[1][:, 0]  # [T, D] (both halves), [T, D/2]
        x = x.view(-1, count, self.attention.head_dim)
        weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        return self.kernels.norm_rope(x, weight, eps, cos, sin)

    def forward(self, x, plan, pool_k, pool_v, rope):
        a = self.attention
        q, k, v = a.qkv_proj(x).split(a.split, dim=-1)
        q = self.heads(q, a.num_heads, a.q_norm, rope)
        k = self.heads(k, a.num_kv_heads, a.k_norm, rope)
        v = v.view(-1, a.num_kv_heads, a.head_dim)
        write_kv(pool_k, pool_v, plan.slot_mapping, k, v)
        out = plan.attend(q, k, v, pool_k, pool_v, a.window)
        return a.o_proj(out.flatten(1))


def glue_copy(module: nn.Module, kernels) -> nn.Module:
    """A copy of ``module``'s tree sharing its parameters, with the kernels' norms and attention
    glue (``kernels``: fast/kernels.py's module); ``module`` is unchanged."""
    # Exactly model.py's classes: a subclass may compute something else.
    if type(module) is RMSNorm:
        return KernelRMSNorm(module, kernels)
    if type(module) is Attention:
        return KernelAttention(glue_copy_children(module, kernels), kernels)
    return glue_copy_children(module, kernels)


def glue_copy_children(module: nn.Module, kernels) -> nn.Module:
    twin = copy.copy(module)  # shares the parameter and buffer dicts; children are replaced
    twin._modules = {name: glue_copy(child, kernels) if child is not None else None
                     for name, child in module._modules.items()}
    return twin
