"""8-bit weights (``quantization="int8"``): int8 per output row with one float32 scale per row.

Symmetric: a row's largest |value| maps to 127. Every linear (the LM head too) and the embedding
keep their weight so, which halves the bytes a decode step streams; activations stay in the
model's dtype. The plain path dequantizes a weight to the activations' dtype and computes as
before (value * scale in float32, rounded once); the fast layer computes from the int8 values
directly (fast/int8_linear.py).
"""
from __future__ import annotations

import torch
from torch import nn

from core.weight_format import WeightFormat


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (values in [-127, 127], float32 scales), value * scale
    within half a scale of the weight."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an int8 part computes with: value * scale in float32, rounded once to ``dtype``."""
    return (weight.float() * scale[:, None].float()).to(dtype)


class Int8Format(WeightFormat):
    """``weight`` int8 ``[rows, columns]`` and ``weight_scale`` float32 ``[rows]`` (vLLM's names
    for a quantized linear's parameters)."""

    name = "int8"
    parameters = ("weight", "weight_scale")

    def create_weights(self, rows, columns, dtype, device):
        return {"weight": nn.Parameter(torch.empty(rows, columns, dtype=torch.int8, device=device),
                                       requires_grad=False),
                "weight_scale": nn.Parameter(torch.empty(rows, dtype=torch.float32, device=device),
                                             requires_grad=False)}

    def quantize(self, weight):
        values, scale = quantize_rows(weight)
        return {"weight": values, "weight_scale": scale}

    def dequantize(self, stored, dtype):
        return dequantize_rows(stored["weight"], stored["weight_scale"], dtype)
