"""The weight formats' registry: what ``quantization=`` may name, each format one object.

A format is a ``WeightFormat`` (core/weight_format.py) in its own file, registered here with
one line. Whatever checks a ``quantization`` value (model.py, the vLLM layer's config) reads
this registry, so a registered format is accepted everywhere at once.
"""
from __future__ import annotations

from core.int4_format import Int4Format
from core.int8_format import Int8Format
from core.q8_0_format import Q8_0Format
from core.weight_format import WeightFormat

FORMATS: dict[str, WeightFormat] = {}


def register(weight_format: WeightFormat) -> WeightFormat:
    """Make ``weight_format`` selectable as ``quantization=weight_format.name``."""
    FORMATS[weight_format.name] = weight_format
    return weight_format


register(Int8Format())
register(Int4Format())
register(Q8_0Format())

class _Names:
    """The registered names, live: ``in`` compares as a tuple's does (an unhashable value is
    simply none of them), iteration lists them."""

    def __contains__(self, value) -> bool:
        return any(value is name or value == name for name in FORMATS)

    def __iter__(self):
        return iter(FORMATS)


QUANTIZATIONS = _Names()  # the values ``quantization`` accepts besides None


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: "
                         f"{', '.join(FORMATS)} (or None)")


def weight_format(quantization: str | None) -> WeightFormat | None:
    """The format ``quantization`` names (None: the weights stay as loaded)."""
    check_quantization(quantization)
    return None if quantization is None else FORMATS[quantization]
