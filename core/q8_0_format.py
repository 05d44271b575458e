"""8-bit weights in blocks (``quantization="q8_0"``), llama.cpp's Q8_0: blocks of 32 inputs,
one float16 scale each, int8 values.

Stored exactly as a GGUF Q8_0 tensor lays a row out (blocks in order), so a GGUF loader copies
them as they are: ``weight`` int8 ``[rows, columns]``, ``weight_scale`` float16
``[rows, columns / 32]``. Element value = q * scale, in float32, rounded once to the
activations' dtype (the plain path's weight: the spec). Quantized at load as llama.cpp's
``quantize_row_q8_0_ref``: d = max |x| / 127 per block, q = roundf(x / d) (half away from zero).

A linear whose columns are not a multiple of 32 is refused (``ValueError`` naming the shape;
model.py adds the part's name). The embedding and a tied LM head are stored in this format too.
Unlike ``int8`` (one scale per row, float activations in its kernel), this format's kernels
quantize activations per block to 8 bits and use integer dot products (fast/block_linear.py).
"""
from __future__ import annotations

import torch
from torch import nn

from core.weight_format import WeightFormat

BLOCK = 32  # inputs per block, GGUF's QK4_0 / QK8_0


def blocks_of(weight: torch.Tensor, name: str) -> torch.Tensor:
    """A float ``[rows, columns]`` weight as float32 ``[rows, columns / 32, 32]``."""
    rows, columns = weight.shape
    if columns % BLOCK:
        raise ValueError(f"{name}: a [{rows}, {columns}] weight: its columns are not a multiple "
                         f"of the block size {BLOCK}")
    return weight.detach().float().unflatten(1, (-1, BLOCK))


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[rows, columns]``, float16 scales ``[rows, columns / 32]``)."""
    blocks = blocks_of(weight, "q8_0")
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    scaled = blocks * inverse
    q = scaled.abs().add_(0.5).floor_().copysign_(scaled)  # C's roundf: half away from zero
    return q.to(torch.int8).flatten(1), d.squeeze(-1).to(torch.float16)


def dequantize_q8_0(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocks = values.float().unflatten(-1, (-1, BLOCK))
    return (blocks * scale.float()[..., None]).flatten(-2).to(dtype)


class Q8_0Format(WeightFormat):
    """``weight`` int8 ``[rows, columns]`` and ``weight_scale`` float16 ``[rows, columns / 32]``."""

    name = "q8_0"
    parameters = ("weight", "weight_scale")

    def create_weights(self, rows, columns, dtype, device):
        return block_parameters(self.name, rows, columns, columns, torch.int8, device)

    def quantize(self, weight):
        values, scale = quantize_q8_0(weight)
        return {"weight": values, "weight_scale": scale}

    def dequantize(self, stored, dtype):
        return dequantize_q8_0(stored["weight"], stored["weight_scale"], dtype)


def block_parameters(name: str, rows: int, columns: int, stored_columns: int, stored: torch.dtype,
                     device) -> dict[str, nn.Parameter]:
    """A block format's parameters: ``weight`` ``[rows, stored_columns]`` of ``stored`` and float16
    ``weight_scale`` ``[rows, columns / 32]``; columns not a multiple of 32 are refused."""
    if columns % BLOCK:
        raise ValueError(f"{name}: a [{rows}, {columns}] weight: its columns are not a multiple "
                         f"of the block size {BLOCK}")
    return {"weight": nn.Parameter(torch.empty(rows, stored_columns, dtype=stored, device=device),
                                   requires_grad=False),
            "weight_scale": nn.Parameter(torch.empty(rows, columns // BLOCK, dtype=torch.float16,
                                                     device=device), requires_grad=False)}
