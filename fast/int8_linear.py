"""The fast layer's kernels for 8-bit weights (core/int8_format.py), which stream the int8 weight
once per call: up to INT8_FEW_ROWS rows (any up to INT8_ROWS where there are no tiles, or the
input is float32) by the few-row kernel (fast/csrc/int8_linear.cpp); bfloat16 rows up to
INT8_TILE_ROWS on AMX's int8 tiles (fast/csrc/int8_tiles.cpp), where the build and Linux grant
them; more rows by one matmul on the weight dequantized for the call (as model.py rounds it),
where the matmul's compute, not the weight's bytes, is the cost. Each kernel also applies
silu(gate) * up of a gate/up linear in the same call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fast.decode_layer import LINEAR_INT8, LINEAR_INT8_TILES
from fast.format_kernels import PLAIN, FormatKernels, RowKernels, silu_mul

INT8_ROWS = 8   # the most rows fast/csrc/int8_linear.cpp takes
# Where AMX's tiles run 8-bit linears: from INT8_FEW_ROWS + 1 rows (fewer: the few-row kernel is
# faster) to INT8_TILE_ROWS (more: the matmul on the dequantized weight is); measured, docs/benchmarks.md.
INT8_FEW_ROWS = 3
INT8_TILE_ROWS = 128


class Int8Kernels(FormatKernels):
    """The compiled module's 8-bit linears; ``tiles``: its AMX tile linears run here."""

    format = "int8"
    fuses_silu_mul = True

    def __init__(self, module, tiles: bool = False) -> None:
        self.module, self.tiles = module, tiles

        def few_rows(part, x, fused):
            return module.int8_linear(x, part.weight, part.weight_scale, part.bias, fused)

        def on_tiles(part, x, fused):
            return module.int8_tiles(x, part.weight, part.weight_scale, part.bias, fused)

        def dequantized(part, x, fused):
            y = F.linear(x, module.int8_dequantize(part.weight, part.weight_scale, x.dtype), part.bias)
            return silu_mul(y) if fused else y

        few_rows.decode_kind, on_tiles.decode_kind = LINEAR_INT8, LINEAR_INT8_TILES  # fast/decode_layer.py
        self.few_rows, self.on_tiles, self.dequantized = few_rows, on_tiles, dequantized

    @classmethod
    def probe(cls, module):
        if not module.int8_linear_available():
            return None, ["8-bit linears (built without AVX-512)"]
        if not module.int8_tiles_available():
            return cls(module), ["8-bit tile linears (built without AMX-INT8 and AVX-512 BF16, or "
                                 "Linux refused the tile registers)"]
        return cls(module, tiles=True), []

    def names(self):
        return ["8-bit linears"] + (["8-bit tile linears"] if self.tiles else [])

    def choose(self, part, dtype):
        """The kernels take bfloat16 or float32 rows and a contiguous weight (the format makes
        one; a weight replaced by another tensor may not be)."""
        if dtype not in (torch.bfloat16, torch.float32) or not part.weight.is_contiguous():
            return RowKernels([PLAIN])
        more = (None, "int8_dequantize + matmul", self.dequantized)
        if self.tiles and dtype == torch.bfloat16:
            return RowKernels([(INT8_FEW_ROWS, "int8_linear", self.few_rows),
                               (INT8_TILE_ROWS, "int8_tiles", self.on_tiles), more])
        return RowKernels([(INT8_ROWS, "int8_linear", self.few_rows), more])
