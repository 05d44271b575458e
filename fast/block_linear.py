"""The fast layer's kernels for llama.cpp's block formats, ``int4`` (Q4_0, core/int4_format.py)
and ``q8_0`` (core/q8_0_format.py), on AVX-512 with VNNI.

Both quantize the activations per block of 32 to int8 (llama.cpp's Q8 activations) and read
the weight with integer dot products, so they compute a little differently from the plain path
(the activations' rounding), within the quality standard of benchmarks/int4_quality.py.
``lane_linear`` (fast/csrc/lane_linear.cpp) holds 16 weight rows in a vector's lanes, so that a
block of 32 costs each input row one float step for 16 weight rows. int4 is stored that way
(core/int4_format.py interleaves its rows by 16), so it runs there at every row count, reading
the weight in place. q8_0 is stored row by row: one row runs ``block_linear``
(fast/csrc/block_linear.cpp), which reads each weight row across a vector's lanes; more rows
run lane_linear, which copies 16 weight rows at a time into the lanes -- the cost past a row,
where block_linear's float step per row and block is. Both apply silu(gate) * up of a gate/up
linear in the same call. A build without AVX-512 VNNI keeps the plain path (the dequantized
weight's matmul) and ``describe()`` says so.
"""
from __future__ import annotations

import torch

from fast.decode_layer import LINEAR_LANES
from fast.format_kernels import PLAIN, FormatKernels, RowKernels

# The most rows block_linear computes for q8_0 (more: lane_linear): where the copy into the lanes
# starts to pay. Measured on the single-user checkpoint, docs/benchmarks.md. int4 has no copy.
Q8_0_DOT_ROWS = 1


class BlockKernels(FormatKernels):
    """The compiled module's block-format linears for the format ``format`` (``bits``: 4 or 8)."""

    fuses_silu_mul = True
    bits = 0
    dot_rows: int | None = 0  # the most rows for block_linear (None: lane_linear for every count)

    def __init__(self, module) -> None:
        self.module = module
        bits = self.bits

        def dots(part, x, fused):
            return module.block_linear(x, part.weight, part.weight_scale, part.bias, bits, fused)

        def lanes(part, x, fused):
            return module.lane_linear(x, part.weight, part.weight_scale, part.bias, bits, fused)

        # fast/decode_layer.py: LINEAR_Q4_0 / LINEAR_Q8_0 are the bits; lane_linear's kinds LINEAR_LANES + them
        dots.decode_kind, lanes.decode_kind = bits, LINEAR_LANES + bits
        self.dots, self.lanes = dots, lanes

    @classmethod
    def probe(cls, module):
        if not (module.block_linear_available() and module.lane_linear_available()):
            return None, [f"{cls.format} linears (built without AVX-512 VNNI: the plain path's "
                          f"dequantized matmul runs them)"]
        return cls(module), []

    def names(self):
        return [f"{self.format} linears"]

    def choose(self, part, dtype):
        """The kernels take bfloat16 or float32 rows and the format's contiguous parameters."""
        if (dtype not in (torch.bfloat16, torch.float32) or not part.weight.is_contiguous()
                or not part.weight_scale.is_contiguous()):
            return RowKernels([PLAIN])
        if self.dot_rows is None:
            return RowKernels([(None, "lane_linear (VNNI, 16 weight rows in the lanes, as stored)", self.lanes)])
        return RowKernels([(self.dot_rows, "block_linear (VNNI, int8 activations)", self.dots),
                           (None, "lane_linear (VNNI, 16 weight rows in the lanes)", self.lanes)])


class Int4Kernels(BlockKernels):
    format, bits, dot_rows = "int4", 4, None


class Q8_0Kernels(BlockKernels):
    format, bits, dot_rows = "q8_0", 8, Q8_0_DOT_ROWS
