"""The fast layer's kernels for llama.cpp's block formats, ``int4`` (Q4_0, core/int4_format.py)
and ``q8_0`` (core/q8_0_format.py), on AVX-512 with VNNI (fast/csrc/block_linear.cpp).

Up to ``dot_rows`` rows (16 for int4, 8 for q8_0): ``block_linear``, which quantizes the
activations per block of 32 to int8 (llama.cpp's Q8 activations) and reads the weight once with
integer dot products; it
computes a little differently from the plain path (the activations' rounding), within the
quality standard of benchmarks/int8_quality.py. More rows: ``block_dequantize_panels``, the
plain path's math (the weight dequantized in the activations' dtype) a panel of rows at a time,
one matmul each, where the matmul's arithmetic, not the weight's bytes, is the cost. Both apply
silu(gate) * up of a gate/up linear in the same call. A build without AVX-512 VNNI keeps the
plain path (the dequantized weight's matmul) and ``describe()`` says so.
"""
from __future__ import annotations

import torch

from fast.format_kernels import PLAIN, FormatKernels, RowKernels

# The most rows the VNNI kernel computes (more: dequantized panels), per format: where the
# kernel's float work per row, not the weight's bytes, starts to cost more than a panel's
# matmul -- later for Q4_0, whose 64-byte load holds twice the weights. Measured on the
# single-user checkpoint, docs/benchmarks.md.
INT4_DOT_ROWS = 16
Q8_0_DOT_ROWS = 8


class BlockKernels(FormatKernels):
    """The compiled module's block-format linears for the format ``format`` (``bits``: 4 or 8)."""

    fuses_silu_mul = True
    bits = 0
    dot_rows = 0  # the most rows for the VNNI kernel

    def __init__(self, module) -> None:
        self.module = module
        bits = self.bits

        def dots(part, x, fused):
            return module.block_linear(x, part.weight, part.weight_scale, part.bias, bits, fused)

        def panels(part, x, fused):
            return module.block_dequantize_panels(x, part.weight, part.weight_scale, part.bias, bits, fused)

        dots.decode_kind = bits  # fast/decode_layer.py: LINEAR_Q4_0 / LINEAR_Q8_0 are the bits
        self.dots, self.panels = dots, panels

    @classmethod
    def probe(cls, module):
        if not module.block_linear_available():
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
        return RowKernels([(self.dot_rows, "block_linear (VNNI, int8 activations)", self.dots),
                           (None, "dequantized panels + matmul", self.panels)])


class Int4Kernels(BlockKernels):
    format, bits, dot_rows = "int4", 4, INT4_DOT_ROWS


class Q8_0Kernels(BlockKernels):
    format, bits, dot_rows = "q8_0", 8, Q8_0_DOT_ROWS
