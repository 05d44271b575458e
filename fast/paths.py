"""Which fast machinery runs: chosen once, here, from the engine's settings and the model.

``choose_paths(model_config, dtype, device, enforce_eager=...)`` is where the paths are picked:
the attention kinds' routes (fast/attention.py), packed linears (fast/linear.py), and, unless
``enforce_eager``, the compiled kernels (fast/kernels.py) within their limits, the weight
formats' among them. The result, a ``FastPaths``, is what ``FastBackend`` runs and what its
``describe()`` prints, the reason for every kernel left off included. A linear in a weight
format then gets its kernel for each row count once, when the backend is built, from the
format's kernels (``FormatKernels.choose``): no call picks one. ``fast_paths=False`` never
gets here: the engine's builder then takes the core's plain ``Backend``. STEP14_CPU_FEATURES_OFF
(below) makes this machine choose as one without AMX, VNNI or AVX-512 BF16 would.

The kernels' limits, as fast/csrc checks them (outside a limit the PyTorch kind runs):

* every kernel: a CPU tensor in float32, bfloat16 or float16 (their softmax and sums are float32);
* the tile kernels (prompt chunks, decode over shared blocks): AVX-512 in the build (there every
  attention kernel computes a row by one recipe, so no kernel choice changes a bit); at most
  ``TILE_MAX_GROUP`` query heads per KV head (a tile's 16 lanes hold one position's heads);
  positions and position + window in int32;
* the few-row linear: bfloat16, AVX-512 BF16 in the build, at most fast/linear.SMALL_ROWS rows;
* the heads' norm + RoPE: an even head_dim (RoPE's halves);
* a weight format's kernels (``FORMAT_KERNELS`` below): as each probes the build; each linear in
  that format then gets its kernel per row count once (fast/format_kernels.py). The 8-bit
  linear (``quantization="int8"``, fast/int8_linear.py): bfloat16 or float32 input, AVX-512 in
  the build, at most INT8_ROWS rows (more rows: one matmul on the weight the kernel module
  dequantizes); its tile linear: bfloat16 input, AMX-INT8 and AVX-512 BF16 in the build, the
  tile registers granted by Linux, INT8_FEW_ROWS + 1 to INT8_TILE_ROWS rows; without tiles,
  bfloat16 input from INT8_LANE_FROM rows: the lane linear (AVX-512 VNNI in the build). The
  block formats (``quantization="int4"`` / ``"q8_0"``, fast/block_linear.py): bfloat16 or
  float32 input, AVX-512 VNNI in the build; up to 2 (int4) or 1 (q8_0) rows ``block_linear``,
  more ``lane_linear`` (activations quantized per block of 32 in both).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from fast.attention import Routes
from fast.block_linear import Int4Kernels, Q8_0Kernels
from fast.format_kernels import FormatKernels
from fast.int8_linear import Int8Kernels
from fast.kernels import KernelBuild, Kernels, compiled_kernels
from fast.linear import onednn_linears_usable

# Weight format (core/formats.py) -> the fast layer's kernels for it. A format without an entry
# computes as model.py does (its dequantized weight's matmul) on every path.
FORMAT_KERNELS: dict[str, type[FormatKernels]] = {
    "int8": Int8Kernels,
    "int4": Int4Kernels,
    "q8_0": Q8_0Kernels,
}

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# STEP14_CPU_FEATURES_OFF=amx,vnni,bf16 (any of them): the kernels that need that CPU feature
# stay off, as on a CPU without it -- so one machine runs, and tests check, the path another
# kind of machine takes. Feature -> the compiled module's probes it answers False.
FEATURE_PROBES = {"amx": ("int8_tiles_available",), "vnni": ("block_linear_available", "lane_linear_available"),
                  "bf16": ("small_linear_available",)}


def features_off() -> tuple[str, ...]:
    """The CPU features STEP14_CPU_FEATURES_OFF turns off for the kernels (unknown names refused)."""
    asked = [f.strip() for f in os.environ.get("STEP14_CPU_FEATURES_OFF", "").split(",") if f.strip()]
    unknown = [f for f in asked if f not in FEATURE_PROBES]
    if unknown:
        raise ValueError(f"STEP14_CPU_FEATURES_OFF: unknown feature(s) {', '.join(unknown)}; "
                         f"known: {', '.join(FEATURE_PROBES)}")
    return tuple(asked)


class WithoutFeatures:
    """The compiled module as a CPU without ``off`` would build it: those probes answer False."""

    def __init__(self, module, off: tuple[str, ...]) -> None:
        self._module, self._off = module, {probe for f in off for probe in FEATURE_PROBES[f]}

    def __getattr__(self, name: str):
        if name in self._off:
            return lambda: False
        return getattr(self._module, name)
TILE_MAX_GROUP = 16          # csrc/attention.cpp: query heads per KV head in one 16-lane tile
INT32_MAX = 2 ** 31 - 1      # csrc/attention.cpp: tile lanes hold positions (+ window) as int32


@dataclass(frozen=True)
class FastPaths:
    """What the fast backend runs, and why anything is off."""

    routes: Routes
    pack_linears: bool
    small_linear: Callable | None = None  # the compiled few-row bfloat16 linear
    glue: Kernels | None = None           # the compiled module for norms and heads' RoPE
    build: KernelBuild | None = None      # None: enforce_eager (no kernels asked for)
    off: tuple[str, ...] = ()             # "what (why)" for each kernel left off
    formats: tuple[FormatKernels, ...] = ()  # the weight formats' kernels this build holds

    def describe(self) -> str:
        parts = ["fast attention", "packed linears" if self.pack_linears else "plain linears"]
        parts.append(self.build.describe() if self.build is not None else "no C++ kernels (enforce_eager)")
        kernels = [name for name, on in (("decode", self.routes.decode_kernel),
                                         ("prompt chunks", self.routes.prefill_kernel),
                                         ("shared decode", self.routes.shared_decode_kernel),
                                         ("few-row linear", self.small_linear),
                                         ("norms and RoPE", self.glue)) if on is not None]
        kernels += [name for kinds in self.formats for name in kinds.names()]
        if kernels:
            parts.append("kernels for " + ", ".join(kernels))
        return ", ".join(parts + ([f"off: {'; '.join(self.off)}"] if self.off else []))


def choose_paths(config, dtype: torch.dtype, device: torch.device, *, enforce_eager: bool,
                 pack_linears: bool | None = None) -> FastPaths:
    """The fast paths for a model (its ``ModelConfig``) in ``dtype`` on ``device``;
    ``pack_linears`` None: where oneDNN computes the dtype natively here."""
    routes = Routes.probe(device, dtype)
    if pack_linears is None:
        pack_linears = onednn_linears_usable(device, dtype)
    if enforce_eager:
        return FastPaths(routes, pack_linears)
    if device.type != "cpu" or dtype not in KERNEL_DTYPES:
        return FastPaths(routes, pack_linears, off=(f"C++ kernels ({device.type} {dtype} is not theirs)",))
    build = compiled_kernels()
    if build.module is None:
        return FastPaths(routes, pack_linears, build=build)
    return _with_kernels(routes, pack_linears, build, config, dtype)


def _with_kernels(routes: Routes, pack_linears: bool, build: KernelBuild, config,
                  dtype: torch.dtype) -> FastPaths:
    module, off, turned_off = build.module, [], features_off()
    if turned_off:
        module = WithoutFeatures(module, turned_off)
        off.append(f"kernels needing {', '.join(turned_off)} (STEP14_CPU_FEATURES_OFF)")
    routes = replace(routes, decode_kernel=module.decode_attention)
    tiles_off = _tile_limits(module, config)
    if tiles_off:
        off.append(f"tile kernels ({tiles_off})")
    else:
        # Prompt chunks by the kernel in every dtype: it computes each row as decode does (one
        # recipe), so the prefix cache and chunking never change a row's bits.
        routes = replace(routes, shared_decode_kernel=module.shared_decode_attention,
                         prefill_kernel=module.prefill_attention)
    small = None
    if dtype == torch.bfloat16:
        small = module.small_linear if module.small_linear_available() else None
        if small is None:
            off.append("few-row linear (built without AVX-512 BF16)")
    glue = module if config.head_dim % 2 == 0 else None
    if glue is None:
        off.append(f"norms and RoPE (odd head_dim {config.head_dim})")
    formats = []
    for kinds in FORMAT_KERNELS.values():
        held, kinds_off = kinds.probe(module)
        formats += [held] if held is not None else []
        off += kinds_off
    return FastPaths(routes, pack_linears, small, glue, build, tuple(off), tuple(formats))


def _tile_limits(module, config) -> str:
    """Why the tile kernels cannot run this model ('' : they can)."""
    group = config.num_heads // config.num_kv_heads
    widest = max([w for w in config.layer_windows if w is not None], default=0)
    if not module.prefill_attention_available():
        return "built without AVX-512"
    if group > TILE_MAX_GROUP:
        return f"{group} query heads per KV head (at most {TILE_MAX_GROUP})"
    if config.max_position_embeddings + widest > INT32_MAX:
        return f"positions + window {config.max_position_embeddings} + {widest} past int32"
    return ""
