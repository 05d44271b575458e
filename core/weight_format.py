"""What a weight format is: how one weight matrix is stored, loaded and computed on the plain path.

A format is one object, in the spirit of vLLM's ``QuantizeMethodBase``. For a linear (or the
embedding) of ``[rows, columns]`` (rows: output features, or tokens of the vocabulary) it

* creates the part's stored parameters (``create_weights``; vLLM's names: ``weight``, and any
  scales beside it such as ``weight_scale``);
* turns a checkpoint's float tensor for some of those rows into what is stored (``quantize``),
  which is how it loads: at start-up, into a fused q/k/v or gate/up slice, into a tied
  embedding, and through ``load_weights`` after start-up (``load``);
* gives back the weight in the activations' dtype (``dequantize``): the plain path computes
  with it, so that is the spec every kernel of the format is tested equal to (``apply``,
  ``embed``).

model.py keeps such a part in a ``FormatLinear`` / ``FormatEmbedding`` and asks its format; it
never looks at a dtype or a parameter's name. The fast layer registers its kernels for a format
by name (fast/paths.py), choosing one per row count once per linear; a format without kernels
there computes as here everywhere.

The one convention the defaults rely on: every stored parameter has the weight's rows as its
first dimension (an int8 ``[rows, columns]`` weight and ``[rows]`` scales; a 4-bit weight packed
two per byte ``[rows, columns / 2]`` and ``[rows, columns / 32]`` block scales), so a fused
slice or the embedding rows of some tokens is the same rows of every stored parameter. A format
that interleaves rows overrides ``stored`` and ``load`` (core/int4_format.py).

Adding a format: a subclass in its own file, and one line in core/formats.py's registry.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

ALL_ROWS = slice(None)


class WeightFormat:
    """The base of every weight format (``name`` is what ``quantization=`` selects)."""

    name: str | None = None
    parameters: tuple[str, ...] = ("weight",)  # what ``create_weights`` makes, main one first
    plain_kernel = "dequantized matmul"  # what ``apply`` runs, for every row count

    # ----------------------------------------------------------------- what a format defines

    def create_weights(self, rows: int, columns: int, dtype: torch.dtype,
                       device: torch.device) -> dict[str, nn.Parameter]:
        """The stored parameters of one ``[rows, columns]`` weight, by name (``parameters``),
        uninitialised; ``dtype`` is the activations' (a format may store in its own)."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """A float ``[rows, columns]`` weight as stored: one tensor per stored parameter, for
        those rows."""
        raise NotImplementedError

    def dequantize(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The ``[rows, columns]`` weight in ``dtype`` from stored tensors (any rows of them)."""
        raise NotImplementedError

    def embedding_format(self) -> WeightFormat | None:
        """The format for the token embedding (and a tied LM head); None: they stay as loaded."""
        return self

    # ----------------------------------------------------------------- built on those

    def stored(self, part: nn.Module, rows=ALL_ROWS) -> dict[str, torch.Tensor]:
        """The part's stored tensors (``rows`` of them: a slice or token ids)."""
        return {name: getattr(part, name)[rows] for name in self.parameters}

    def apply(self, part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The plain path's linear: the dequantized weight's matmul."""
        return F.linear(x, self.dequantize(self.stored(part), x.dtype), part.bias)

    def embed(self, part: nn.Module, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The embedding rows of ``input_ids``, dequantized (only those rows)."""
        return self.dequantize(self.stored(part, input_ids), dtype)

    def expected_shape(self, part: nn.Module, name: str, tensor: torch.Tensor,
                       rows=ALL_ROWS) -> tuple[int, ...] | None:
        """The shape a checkpoint tensor ``name`` for ``rows`` of the part must have (None: the
        part takes no such tensor). A float ``weight`` is the unquantized ``[rows, columns]``,
        whatever is stored; anything else (a bias, a stored tensor given as stored) the
        parameter's own."""
        if name == self.parameters[0] and tensor.is_floating_point():
            count, columns = part.weight_shape
            return len(range(count)[rows]), columns
        return UNQUANTIZED.expected_shape(part, name, tensor, rows)

    def load(self, part: nn.Module, name: str, tensor: torch.Tensor, rows=ALL_ROWS,
             dtype: torch.dtype | None = None) -> None:
        """Write a checked checkpoint tensor into ``rows`` of the part, in place (version
        counters move): a float ``weight`` quantized (as ``dtype``, the model's, holds it: a
        fresh load quantizes the model as loaded in its dtype), anything else as stored."""
        if name != self.parameters[0] or not tensor.is_floating_point():
            return UNQUANTIZED.load(part, name, tensor, rows)
        for stored_name, value in self.quantize(as_loaded(tensor, dtype)).items():
            target = getattr(part, stored_name)[rows]
            target.copy_(value.to(device=target.device, dtype=target.dtype))


class Unquantized(WeightFormat):
    """Weights as the checkpoint gives them, in the parameter's dtype: how every part without a
    format (plain linears, norms, the float embedding) loads."""

    def create_weights(self, rows, columns, dtype, device):
        return {"weight": nn.Parameter(torch.empty(rows, columns, dtype=dtype, device=device),
                                       requires_grad=False)}

    def quantize(self, weight):
        return {"weight": weight}

    def dequantize(self, stored, dtype):
        return stored["weight"].to(dtype)

    def embedding_format(self):
        return None

    def expected_shape(self, part, name, tensor, rows=ALL_ROWS):
        param = part._parameters.get(name)
        if param is None:
            return None
        return (len(range(param.shape[0])[rows]),) + tuple(param.shape[1:])

    def load(self, part, name, tensor, rows=ALL_ROWS, dtype=None):
        target = part._parameters[name][rows]
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))


UNQUANTIZED = Unquantized()


def as_loaded(weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A float checkpoint weight as a model in ``dtype`` holds it (None: as it is)."""
    return weight if dtype is None else weight.to(dtype)
