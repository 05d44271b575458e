"""The fast layer's compiled kernels: C++ in fast/csrc/, built once per machine by torch's
extension loader and cached on disk (``TORCH_EXTENSIONS_DIR``, by default under ~/.cache).

One module, eight kernel files: paged attention (csrc/attention.cpp: decode rows, prompt chunks,
and decode rows sharing a prefix), which reads keys and values straight from their blocks
where the PyTorch kinds spend a dozen small ops per layer; bfloat16 linears of a few rows
(csrc/small_linear.cpp), which stream each weight once at a decode step of one or a few
sequences; linears on 8-bit weights, for a few rows (csrc/int8_linear.cpp) and on AMX's tiles
for more (csrc/int8_tiles.cpp), which stream the int8 weight once; linears on llama.cpp's
block formats Q4_0 and Q8_0 (csrc/block_linear.cpp: VNNI integer dot products against
activations quantized per block, a weight row across the lanes) and, for more rows, those and
int8 with 16 weight rows in the lanes (csrc/lane_linear.cpp); and a layer's glue
(csrc/layer_glue.cpp: RMSNorm, the heads' norm and RoPE), one call where PyTorch spends
several small ops; and a decode step's whole decoder layer (csrc/decode_layer.cpp), those
kernels composed in C++ where Python would call each. csrc/kernels.h declares what they export,
csrc/simd_math.h holds the vector math several of them share, csrc/outputs.h a linear's
last step (scale, bias, silu, rounding; 16 outputs at a time), csrc/balance.h how a decode
kernel's items are shared over the threads (a range each, the idle taking from the back). A machine without a C++ compiler (or ninja) keeps
the PyTorch kinds and says why (``KernelBuild.reason``); nothing else changes. The first build
takes a while, the cached one about a second to load; ``KernelBuild`` records which it was and
how long.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from torch import Tensor

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("bindings.cpp", "attention.cpp", "small_linear.cpp",
                                         "int8_linear.cpp", "int8_tiles.cpp", "block_linear.cpp",
                                         "lane_linear.cpp", "layer_glue.cpp", "decode_layer.cpp"))
HEADERS = (CSRC / "simd_math.h", CSRC / "outputs.h", CSRC / "checks.h", CSRC / "kernels.h", CSRC / "balance.h")
# -fopenmp: at::parallel_for is inline OpenMP; without it the kernel runs on one thread. The
# OpenMP runtime it links is the one torch already loaded (same soname, libgomp.so.1).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
# STEP14_SANITIZE=address builds a checked copy of the kernels (its own name, so its own cache):
# AddressSanitizer and UBSan, and bounds-checked std::vector. Python must load libasan first
# (LD_PRELOAD); ``python -m tools.sanitize`` sets that up and runs the kernel sweep under it.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                  "-g", "-D_GLIBCXX_ASSERTIONS")


def build_flags() -> tuple[tuple[str, ...], list[str]]:
    """Compiler and linker flags of this process's build (sanitized where asked)."""
    if os.environ.get("STEP14_SANITIZE", "") == "address":
        return FLAGS + SANITIZE_FLAGS, ["-fopenmp", "-fsanitize=address,undefined"]
    return FLAGS, ["-fopenmp"]


class Kernels(Protocol):
    """The compiled module as Python calls it (fast/csrc/bindings.cpp); Tensor arguments only,
    on the CPU. Each ``*_available`` says whether this build's CPU flags hold that kernel."""

    def decode_attention(self, q: Tensor, pool_k: Tensor, pool_v: Tensor, rows: Tensor, tables: Tensor,
                         lo: Tensor, hi: Tensor, block_size: int, scale: float, out: Tensor,
                         vector: bool = True) -> None: ...
    def prefill_attention_available(self) -> bool: ...
    def prefill_attention(self, q: Tensor, pool_k: Tensor, pool_v: Tensor, first_token: Tensor,
                          starts: Tensor, lengths: Tensor, tables: Tensor, block_size: int, scale: float,
                          window: int, out: Tensor) -> None: ...
    def shared_decode_attention(self, q: Tensor, pool_k: Tensor, pool_v: Tensor, rows: Tensor,
                                tables: Tensor, hi: Tensor, shared_blocks: int, block_size: int,
                                scale: float, out: Tensor) -> None: ...
    def small_linear_available(self) -> bool: ...
    def small_linear(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                     silu_mul: bool = False) -> Tensor: ...
    def int8_linear_available(self) -> bool: ...
    def int8_linear(self, x: Tensor, weight: Tensor, scale: Tensor, bias: Optional[Tensor] = None,
                    silu_mul: bool = False) -> Tensor: ...
    def int8_tiles_available(self) -> bool: ...
    def int8_tiles(self, x: Tensor, weight: Tensor, scale: Tensor, bias: Optional[Tensor] = None,
                   silu_mul: bool = False) -> Tensor: ...
    def int8_dequantize(self, weight: Tensor, scale: Tensor, dtype) -> Tensor: ...
    def block_linear_available(self) -> bool: ...
    def block_linear(self, x: Tensor, weight: Tensor, scale: Tensor, bias: Optional[Tensor] = None,
                     bits: int = 4, silu_mul: bool = False) -> Tensor: ...
    def block_dequantize(self, weight: Tensor, scale: Tensor, bits: int, dtype) -> Tensor: ...
    def lane_linear_available(self) -> bool: ...
    def lane_linear(self, x: Tensor, weight: Tensor, scale: Tensor, bias: Optional[Tensor] = None,
                    format: int = 4, silu_mul: bool = False) -> Tensor: ...
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...
    def LayerWeights(self, norms: list, eps: float, kinds: list, weights: list, scales: list, biases: list,
                     q_norm: Optional[Tensor], k_norm: Optional[Tensor], head_eps: float, scale: float): ...
    def decode_layer(self, x: Tensor, layer, cos: Tensor, sin: Tensor, pool_k: Tensor, pool_v: Tensor,
                     slots: Tensor, rows: Tensor, tables: Tensor, lo: Tensor, hi: Tensor,
                     block_size: int) -> Tensor: ...
    def norm_rope(self, x: Tensor, weight: Optional[Tensor], eps: float, cos: Tensor,
                  sin: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class KernelBuild:
    """The outcome of loading the kernels: the module, or why not; seconds; built or cached."""

    module: Kernels | None
    seconds: float
    built: bool          # compiled in this process (False: loaded from the disk cache)
    reason: str = ""     # why there is no module

    def describe(self) -> str:
        if self.module is None:
            return f"no C++ kernels ({self.reason})"
        return f"C++ kernels ({'built' if self.built else 'cached'}, {self.seconds:.1f} s)"


def _name() -> str:
    """A name per source, flags and checkout: an edited kernel never loads a stale build, and two
    checkouts on one machine (whose build files name their own absolute source paths) each keep
    their own build instead of rebuilding each other's."""
    key = b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(build_flags()[0]).encode() + str(CSRC).encode()
    return f"step14_kernels_{hashlib.sha256(key).hexdigest()[:12]}"


def _build_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory(_name(), verbose=False))


def _library_mtime() -> float | None:
    libraries = list(_build_dir().glob("*.so"))
    return max(p.stat().st_mtime for p in libraries) if libraries else None


@functools.cache
def compiled_kernels() -> KernelBuild:
    """Load (building if needed) the compiled kernels once per process."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return KernelBuild(None, 0.0, False, f"no C++ compiler {compiler!r} on PATH")
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load
        before = _library_mtime()
        cflags, ldflags = build_flags()
        module = load(name=_name(), sources=[str(p) for p in SOURCES], extra_cflags=list(cflags),
                      extra_ldflags=ldflags, verbose=False)
    except Exception as err:  # a compiler that fails, no ninja, ...: the PyTorch kinds stay
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        warnings.warn(f"fast layer: the C++ kernels could not be built, the fast layer stays on PyTorch "
                      f"ops and oneDNN ({reason})", RuntimeWarning, stacklevel=2)
        return KernelBuild(None, time.perf_counter() - started, False, reason)
    built = before is None or _library_mtime() != before  # ninja rebuilds an edited source
    return KernelBuild(module, time.perf_counter() - started, built)
