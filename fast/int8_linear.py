"""The fast layer's kernels for 8-bit weights (core/int8_format.py), which stream the int8 weight
once per call. One row by the few-row kernel (fast/csrc/int8_linear.cpp), exact activations;
more rows, where AMX's int8 tiles run bfloat16 rows (fast/csrc/int8_tiles.cpp; the build and
Linux grant them): up to INT8_FEW_ROWS rows the few-row kernel, to INT8_TILE_ROWS the tiles,
more one matmul on the weight dequantized for the call (as model.py rounds it). Bfloat16 rows
without tiles, on AVX-512 VNNI: ``lane_linear`` (fast/csrc/lane_linear.cpp), 16 weight rows at
a time in the lanes of integer dot products against activations quantized per block of 32
(llama.cpp's Q8 activations: a rounding of bfloat16's order, held to the quality standard of
benchmarks/int8_quality.py), where the few-row kernel's float multiply per weight and row is the
cost. Float32 rows keep exact activations (the tokens of the dequantized checkpoint): the
few-row kernel at every row count, INT8_ROWS rows at a time over weight tiles held in cache, so
a row's bits do not depend on the rows beside it (the prefix cache and batching never change
them). Bfloat16 rows with neither tiles nor VNNI: the few-row kernel up to INT8_ROWS, then the
dequantized matmul. Each kernel also applies silu(gate) * up
of a gate/up linear in the same call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fast.decode_layer import LINEAR_INT8, LINEAR_INT8_TILES, LINEAR_LANES
from fast.format_kernels import PLAIN, FormatKernels, RowKernels, silu_mul

INT8_ROWS = 8   # rows fast/csrc/int8_linear.cpp takes at once (MAX_ROWS); the bfloat16 few-row span
# Where AMX's tiles run 8-bit linears: from INT8_FEW_ROWS + 1 rows (fewer: the few-row kernel is
# faster) to INT8_TILE_ROWS (more: the matmul on the dequantized weight is); measured, docs/benchmarks.md.
INT8_FEW_ROWS = 3
INT8_TILE_ROWS = 128
INT8_LANE_FROM = 2  # lane_linear from this many rows where there are no tiles (measured too)


class Int8Kernels(FormatKernels):
    """The compiled module's 8-bit linears; ``tiles``: its AMX tile linears run here."""

    format = "int8"
    fuses_silu_mul = True

    def __init__(self, module, tiles: bool = False, lanes: bool = False) -> None:
        self.module, self.tiles, self.lanes = module, tiles, lanes

        def few_rows(part, x, fused):
            return module.int8_linear(x, part.weight, part.weight_scale, part.bias, fused)

        def on_tiles(part, x, fused):
            return module.int8_tiles(x, part.weight, part.weight_scale, part.bias, fused)

        def dequantized(part, x, fused):
            y = F.linear(x, module.int8_dequantize(part.weight, part.weight_scale, x.dtype), part.bias)
            return silu_mul(y) if fused else y

        def in_lanes(part, x, fused):
            return module.lane_linear(x, part.weight, part.weight_scale, part.bias, 1, fused)

        few_rows.decode_kind, on_tiles.decode_kind = LINEAR_INT8, LINEAR_INT8_TILES  # fast/decode_layer.py
        in_lanes.decode_kind = LINEAR_LANES + 1
        self.few_rows, self.on_tiles, self.dequantized, self.in_lanes = few_rows, on_tiles, dequantized, in_lanes

    @classmethod
    def probe(cls, module):
        if not module.int8_linear_available():
            return None, ["8-bit linears (built without AVX-512)"]
        lanes, off = module.lane_linear_available(), []
        if not lanes:
            off.append("8-bit lane linears (built without AVX-512 VNNI)")
        if not module.int8_tiles_available():
            return cls(module, lanes=lanes), off + ["8-bit tile linears (built without AMX-INT8 and "
                                                    "AVX-512 BF16, or Linux refused the tile registers)"]
        return cls(module, tiles=True, lanes=lanes), off

    def names(self):
        return (["8-bit linears"] + (["8-bit lane linears"] if self.lanes else [])
                + (["8-bit tile linears"] if self.tiles else []))

    def choose(self, part, dtype):
        """The kernels take bfloat16 or float32 rows and a contiguous weight (the format makes
        one; a weight replaced by another tensor may not be)."""
        if dtype not in (torch.bfloat16, torch.float32) or not part.weight.is_contiguous():
            return RowKernels([PLAIN])
        more = (None, "int8_dequantize + matmul", self.dequantized)
        if self.tiles and dtype == torch.bfloat16:
            return RowKernels([(INT8_FEW_ROWS, "int8_linear", self.few_rows),
                               (INT8_TILE_ROWS, "int8_tiles", self.on_tiles), more])
        if self.lanes and dtype == torch.bfloat16:
            return RowKernels([(INT8_LANE_FROM - 1, "int8_linear", self.few_rows),
                               (None, "lane_linear (VNNI, int8 activations)", self.in_lanes)])
        if dtype == torch.float32:  # exact activations, and a row's bits at any row count
            return RowKernels([(None, "int8_linear (any rows, 8 at a time)", self.few_rows)])
        return RowKernels([(INT8_ROWS, "int8_linear", self.few_rows), more])
