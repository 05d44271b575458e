"""The fast layer's kernels for a weight format: for each linear, the kernel of each row count.

A weight format (core/weight_format.py) computes its linears on the plain path from their
dequantized weight. The fast layer may hold kernels for it: a ``FormatKernels`` subclass in its
own file (fast/int8_linear.py), registered by the format's name in fast/paths.py, where the
paths are chosen. For each linear part in that format it chooses once a ``RowKernels`` -- which
kernel computes 1, 2, ... rows, and which any more -- and ``FormatLinearKernel`` runs it (it
chooses again only when the part's weight is replaced by another tensor). The backend's
``describe()`` prints each linear's choice. An MLP whose gate/up linear runs kernels that apply
silu(gate) * up in the same call runs so (``FusedSiluMLP``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fast.linear import has_hooks
from model import MLP, FormatLinear

# (part, x, silu_mul) -> the part's output (silu(gate) * up of it where ``silu_mul``)
Kernel = Callable[[FormatLinear, torch.Tensor, bool], torch.Tensor]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def plain(part: FormatLinear, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """model.py's own math: the format's dequantized weight's matmul."""
    y = part.compute(x)
    return silu_mul(y) if fused else y


PLAIN = (None, "dequantized matmul (model.py)", plain)


class RowKernels:
    """One linear's kernel for each row count: ``spans`` of (most rows, name, kernel) in
    order, the last (most rows None) for any more; a span that starts past its own limit
    covers no row count."""

    def __init__(self, spans: Sequence[tuple[int | None, str, Kernel]]) -> None:
        *bounded, (_, _, more) = spans
        table: list[Kernel] = []
        for most, _, kernel in bounded:
            table += [kernel] * (most + 1 - len(table))
        self.spans, self.by_rows, self.more = tuple(spans), tuple(table), more
        # what fast/decode_layer.py calls each row count's kernel (a kernel's ``decode_kind``)
        self.kinds = tuple(getattr(kernel, "decode_kind", None) for kernel in table)
        self.more_kind = getattr(more, "decode_kind", None)

    def kernel(self, x: torch.Tensor) -> Kernel:
        rows = x.shape[0] if x.dim() == 2 else len(self.by_rows)
        return self.by_rows[rows] if rows < len(self.by_rows) else self.more

    def decode_kind(self, x: torch.Tensor) -> int | None:
        """What fast/decode_layer.py calls the kernel for ``x`` (a kernel's ``decode_kind``), or
        None where that file has no name for it."""
        rows = x.shape[0]
        return self.kinds[rows] if rows < len(self.kinds) else self.more_kind

    def describe(self) -> str:
        out, first = [], 1
        for most, name, _ in self.spans:
            if most is None:
                out.append(f"{first}+ rows {name}" if first > 1 else f"any rows {name}")
            elif most >= first:
                out.append(f"{first}-{most} rows {name}" if most > first else f"{first} row {name}")
                first = most + 1
        return ", ".join(out)


class FormatKernels:
    """The fast layer's kernels for the weight format named ``format``, probed once
    (``probe``); ``choose`` gives one linear's ``RowKernels`` for activations in ``dtype``."""

    format = ""
    fuses_silu_mul = False  # its kernels can apply silu(gate) * up of a gate/up linear

    @classmethod
    def probe(cls, module) -> tuple[FormatKernels | None, list[str]]:
        """(the kernels of this build, or None; "what (why)" for each kernel left off)."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """What describe()'s "kernels for" list says for these."""
        raise NotImplementedError

    def choose(self, part: FormatLinear, dtype: torch.dtype) -> RowKernels:
        raise NotImplementedError


class FormatLinearKernel:
    """One format linear computed by the kernels chosen for it."""

    def __init__(self, kernels: FormatKernels, part: FormatLinear, dtype: torch.dtype) -> None:
        self.kernels, self.dtype = kernels, dtype
        self.weight, self.rows = part.weight, kernels.choose(part, dtype)

    def __call__(self, part: FormatLinear, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.chosen(part).kernel(x)(part, x, fused)

    def chosen(self, part: FormatLinear) -> RowKernels:
        if part.weight is not self.weight:  # a replaced parameter: its layout may differ
            self.weight, self.rows = part.weight, self.kernels.choose(part, self.dtype)
        return self.rows

    def decode_kind(self, part: FormatLinear, x: torch.Tensor) -> int | None:
        return self.chosen(part).decode_kind(x)

    def describe(self) -> str:
        return self.rows.describe()


class FusedSiluMLP:
    """model.MLP with SiLU on a format linear: gate, up and silu(gate) * up in one kernel call
    (``gate_up``: that linear's kernels); then the part's own down projection."""

    def __init__(self, gate_up: FormatLinearKernel) -> None:
        self.gate_up = gate_up

    def __call__(self, part: MLP, x: torch.Tensor) -> torch.Tensor:
        linear = part.gate_up_proj
        if part.hidden_act != "silu" or has_hooks(linear) or not linear.computes_as_declared():
            return part.compute(x)
        return part.down_proj(self.gate_up(linear, x, True))

    def decode_kind(self, part: MLP, x: torch.Tensor) -> int | None:
        """The gate/up kernel fast/decode_layer.py calls for ``x`` (silu(gate) * up in it)."""
        linear = part.gate_up_proj
        if part.hidden_act != "silu" or has_hooks(linear) or not linear.computes_as_declared():
            return None
        return self.gate_up.decode_kind(linear, x)


def format_replacements(model: nn.Module, kernels: FormatKernels) -> dict:
    """A replacement per linear part in ``kernels``' format, and per SiLU MLP over one where
    the kernels fuse it (part name -> callable)."""
    out, chosen = {}, {}
    parts = list(model.replaceable_parts())
    for name, part in parts:
        if part.kind == "format_linear" and part.weight_format.name == kernels.format:
            out[name] = chosen[part] = FormatLinearKernel(kernels, part, model.dtype)
    for name, part in parts:
        if (kernels.fuses_silu_mul and part.kind == "mlp" and part.hidden_act == "silu"
                and part.gate_up_proj in chosen):
            out[name] = FusedSiluMLP(chosen[part.gate_up_proj])
    return out
