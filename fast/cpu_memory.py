"""Memory on CPU: freed memory kept for the next step, and the KV pool on huge pages.

Two settings of the process, each measured on a 2-core AVX-512 machine (Qwen3-0.6B's shape,
bfloat16); neither changes a result, only where bytes live:

* Kept memory. glibc's malloc serves every allocation above its mmap threshold (128 KiB to
  start) with a fresh mapping, unmaps it on free, and trims freed heap memory back to the
  OS. A step allocates and frees the same multi-MB activations every layer, so each touched
  its pages anew: a bfloat16-to-float32 copy of a [1152, 1024] activation took 575 us into a
  new tensor against 75 us into kept memory, and a prompt's prefill ran 1.6x faster.
  Raising the mmap threshold to glibc's maximum (32 MiB) and the trim threshold keeps those
  pages; the cost is that the process keeps its peak heap.
* The KV pool on huge pages. Decode attention reads every sequence's blocks, 4 KiB rows
  scattered over gigabytes; on 4 KiB pages nearly every row is a TLB miss. Advised for 2 MiB
  transparent huge pages before first touch, gathering one layer's keys of a batch-16 step
  and scoring them took 1.73 ms against 3.14 ms.

Not done: collapsing the weights onto huge pages after loading (``MADV_COLLAPSE``). Alone, the
linears of a batch-16 step ran 63.7 -> 43.6 ms, but in the engine no gain showed above the
host's noise, and it added 9-13 s to a 0.6B engine's 14 s start-up.

Linux with glibc only (elsewhere, or with ``STEP14_TUNE_CPU_MEMORY=0``, nothing changes);
a kernel that refuses the advice leaves the pages as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
MADV_HUGEPAGE = 14  # madvise's advice number (linux/mman.h)
HUGE_PAGE = 2 << 20


@functools.cache
def _libc():
    """glibc, or None (not Linux with glibc, or switched off)."""
    if os.environ.get("STEP14_TUNE_CPU_MEMORY", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # musl, macOS, Windows
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; whether they are now set."""
    libc = _libc()
    return (libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
            and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape), on CPU in memory advised for transparent huge pages before it is
    first touched (a view into a slightly larger buffer aligned to a huge page)."""
    libc = _libc()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or libc is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    libc.madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return empty_on_huge_pages(shape, dtype, device).zero_()
