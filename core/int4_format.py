"""4-bit weights (``quantization="int4"``), llama.cpp's Q4_0 class: blocks of 32 inputs, one
float16 scale each, 4-bit values stored with an offset of 8.

A row is quantized exactly as a GGUF Q4_0 tensor lays it out (``quantize_q4_0``): 16 bytes per
block of 32 columns, byte j (0..15) holding element j in its low nibble and element j + 16 in its
high nibble, and one float16 scale per block. Element value = (nibble - 8) * scale, in float32,
rounded once to the activations' dtype (the plain path's weight, the spec every kernel is tested
against).

The parameters hold those bytes with the rows interleaved, as llama.cpp's CPU backend repacks
Q4_0 at load: rows in groups of 16 (the last group may hold fewer), and within a group, block by
block, each 4-byte word of the block for every row of the group in turn. ``weight`` stays uint8
``[rows, columns / 2]`` and ``weight_scale`` float16 ``[rows, columns / 32]`` (the same bytes,
another order; a scale is its own word). So one 64-byte load holds the same four bytes of 16
rows, and a kernel multiplies 16 rows at once with no copy and no sum across lanes
(fast/csrc/lane_linear.cpp). ``stored`` gives the rows back in GGUF's order and ``load`` takes
them so (a GGUF file's blocks, a quantized checkpoint slice), so only these parameters see the
interleaving.

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
from core.weight_format import ALL_ROWS, UNQUANTIZED, WeightFormat, as_loaded

GROUP = 16  # rows interleaved together: one per int32 lane of a 64-byte vector
WORDS = {"weight": 4, "weight_scale": 1}  # each stored parameter's word (elements kept together)


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


def rows_in_groups(rows: torch.Tensor, word: int) -> torch.Tensor:
    """``[n, c]`` rows in order -> the same ``[n, c]`` elements interleaved: per group of 16 rows
    (the last may hold fewer), word by word (``word`` elements), every row of the group in turn."""
    n, c = rows.shape
    full = n - n % GROUP
    head = rows[:full].reshape(full // GROUP, GROUP, c // word, word).transpose(1, 2)
    tail = rows[full:].reshape(n - full, c // word, word).transpose(0, 1)
    return torch.cat((head.reshape(full, c), tail.reshape(n - full, c)))


def rows_from_groups(stored: torch.Tensor, word: int) -> torch.Tensor:
    """The inverse of ``rows_in_groups``: the rows in order."""
    n, c = stored.shape
    full = n - n % GROUP
    head = stored[:full].reshape(full // GROUP, c // word, GROUP, word).transpose(1, 2)
    tail = stored[full:].reshape(c // word, n - full, word).transpose(0, 1)
    return torch.cat((head.reshape(full, c), tail.reshape(n - full, c)))


def interleave_q4_0(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_q4_0``'s (GGUF-ordered) rows as the parameters hold them."""
    return rows_in_groups(packed, WORDS["weight"]), rows_in_groups(scale, WORDS["weight_scale"])


def _groups_of(rows, count: int):
    """(the stored rows of the whole groups that hold ``rows``, ``rows`` within them); a slice of
    ``range(count)``, else every row."""
    span = range(count)[rows] if isinstance(rows, slice) else None
    if span is None or span.step != 1 or not span:
        return ALL_ROWS, rows
    start = span.start - span.start % GROUP
    return slice(start, min(count, -(-span.stop // GROUP) * GROUP)), slice(span.start - start, span.stop - start)


class Int4Format(WeightFormat):
    """``weight`` uint8 ``[rows, columns / 2]`` (two 4-bit values a byte) and ``weight_scale``
    float16 ``[rows, columns / 32]``, rows interleaved by 16 (``rows_in_groups``); ``quantize``
    and ``dequantize`` speak GGUF's order, as ``stored`` and ``load`` do."""

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

    def stored(self, part, rows=ALL_ROWS):
        """The part's rows in GGUF's order (the parameters interleave them)."""
        return {name: rows_from_groups(getattr(part, name), WORDS[name])[rows] for name in self.parameters}

    def load(self, part, name, tensor, rows=ALL_ROWS, dtype=None):
        """A float ``weight`` quantized (as ``dtype`` holds it), or a stored tensor in GGUF's
        order (a GGUF file's blocks), into ``rows``: the whole groups holding them are read back
        in order, written, and interleaved again, in place (version counters move)."""
        if name not in self.parameters:
            return UNQUANTIZED.load(part, name, tensor, rows)
        floating = name == "weight" and tensor.is_floating_point()
        values = self.quantize(as_loaded(tensor, dtype)) if floating else {name: tensor}
        for stored_name, value in values.items():
            param, word = getattr(part, stored_name), WORDS[stored_name]
            groups, within = _groups_of(rows, param.shape[0])
            block = rows_from_groups(param[groups], word)
            block[within] = value.to(device=block.device, dtype=block.dtype)
            param[groups].copy_(rows_in_groups(block, word))
