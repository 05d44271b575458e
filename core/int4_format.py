"""4-bit weights (``quantization="int4"``), llama.cpp's Q4_0 class: blocks of 32 inputs, one
float16 scale each, 4-bit values stored with an offset of 8.

Stored exactly as a GGUF Q4_0 tensor lays a row out, so a GGUF loader copies blocks as they
are: ``weight`` uint8 ``[rows, columns / 2]``, 16 bytes per block of 32 columns, byte j (0..15)
holding element j in its low nibble and element j + 16 in its high nibble; ``weight_scale``
float16 ``[rows, columns / 32]``. Element value = (nibble - 8) * scale, in float32, rounded once
to the activations' dtype (the plain path's weight, the spec every kernel is tested against).

Quantized at load as llama.cpp's ``quantize_row_q4_0_ref`` does: a block's element of largest
magnitude, with its sign, maps to -8 (d = that / -8), the others to min(15, trunc(x / d + 8.5)).

What this format decides:

* a linear whose columns are not a multiple of 32 is refused (``ValueError`` naming the shape;
  model.py adds the part's name): a block never straddles the end of a row, as in GGUF;
* the token embedding, and an LM head tied to it, are stored in Q8_0 (core/q8_0_format.py):
  the head is the linear the output is most sensitive to, its rows are read once per step
  like any linear's, and llama.cpp also keeps its output matrix above 4 bits. An untied LM
  head is a linear like the others: 4-bit.
"""
from __future__ import annotations

import torch

from core.q8_0_format import BLOCK, Q8_0Format, block_parameters, blocks_of
from core.weight_format import WeightFormat


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 ``[rows, columns / 2]``, float16 scales ``[rows, columns / 32]``)."""
    blocks = blocks_of(weight, "int4")
    signed_max = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # the first, if tied
    d = signed_max / -8
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    # x / d lies in [-8, 8]: + 8.5 keeps it positive, so truncation is llama.cpp's int cast.
    q = torch.trunc(blocks * inverse + 8.5).clamp_(max=15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.flatten(1), d.squeeze(-1).to(torch.float16)


def unpack_q4_0(packed: torch.Tensor) -> torch.Tensor:
    """The nibbles of packed rows ``[..., columns / 2]`` as uint8 ``[..., columns]``, in order."""
    pairs = packed.unflatten(-1, (-1, BLOCK // 2))
    return torch.cat((pairs & 15, pairs >> 4), dim=-1).flatten(-2)


def dequantize_q4_0(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = unpack_q4_0(packed).float().sub_(8).unflatten(-1, (-1, BLOCK))
    return (values * scale.float()[..., None]).flatten(-2).to(dtype)


class Int4Format(WeightFormat):
    """``weight`` uint8 ``[rows, columns / 2]`` (two 4-bit values a byte, GGUF Q4_0's order)
    and ``weight_scale`` float16 ``[rows, columns / 32]``."""

    name = "int4"
    parameters = ("weight", "weight_scale")

    def create_weights(self, rows, columns, dtype, device):
        return block_parameters(self.name, rows, columns, columns // 2, torch.uint8, device)

    def quantize(self, weight):
        packed, scale = quantize_q4_0(weight)
        return {"weight": packed, "weight_scale": scale}

    def dequantize(self, stored, dtype):
        return dequantize_q4_0(stored["weight"], stored["weight_scale"], dtype)

    def embedding_format(self):
        return Q8_0Format()
