"""How many threads torch computes with on CPU: the cores nobody else is keeping busy.

torch splits each op over its OpenMP threads and waits for the slowest. When another process
holds a core, the thread scheduled there is descheduled for whole time slices and every op
waits for it: on 2 cores, one busy neighbour made a batch-16 decode step ten times slower with
2 threads than with 1. So the policy measures how much CPU *other* processes use on our cores
(/proc/stat minus this process's own time) and computes with the rest, never fewer than one.
It re-checks every few seconds, so the engine takes a core back when the neighbour leaves.

    policy = ThreadPolicy()      # at engine start-up (CPU only)
    policy.maybe_update()        # every step: rate-limited, reads /proc only every few seconds

Linux only (it reads /proc); elsewhere it leaves torch's thread count alone.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class CpuSample:
    """Cumulative clock ticks at one moment, over the cores this process may run on."""

    total: int  # all time of those cores, idle included
    busy: int   # time any process (or the kernel, or the hypervisor: steal) used them
    own: int    # time this process used (all its threads)


def read_sample(cores: set[int]) -> CpuSample | None:
    """Current tick counters, or None where /proc is not there to read."""
    try:
        with open("/proc/stat") as f:
            stat = f.read().splitlines()
        with open("/proc/self/stat") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    total = busy = 0
    for line in stat:
        name, *ticks = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        values = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    own = int(own_fields[11]) + int(own_fields[12])  # utime + stime
    return CpuSample(total, busy, own)


def cores_used_by_others(before: CpuSample, after: CpuSample, num_cores: int) -> float:
    """Average number of our cores that other processes kept busy between two samples."""
    elapsed = (after.total - before.total) / num_cores  # ticks of wall time
    if elapsed <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / elapsed)


# torch's thread count is process-wide: remember what policies set it to, so that a count a
# policy lowered (a busy neighbour, since gone) is not mistaken for the caller's own choice.
_set_by_policy: int | None = None
_callers_threads: int | None = None


def callers_thread_count() -> int:
    """torch's thread count as the caller (or torch's default) chose it, not as a policy left it."""
    global _callers_threads
    now = torch.get_num_threads()
    if _callers_threads is None or now != _set_by_policy:
        _callers_threads = now
    return _callers_threads


def set_threads(threads: int) -> None:
    global _set_by_policy
    torch.set_num_threads(threads)
    _set_by_policy = threads


@dataclass
class ThreadPolicy:
    """Sets torch's intra-op threads to the idle cores, re-checked every ``check_every_s``.

    ``max_threads`` caps it (default: torch's thread count as the caller set it, so a caller's
    ``torch.set_num_threads(1)`` is respected, while a count an earlier policy lowered is not
    taken for a choice). A core counts as taken when others used at least half of it on
    average since the last check.
    """

    max_threads: int | None = None
    check_every_s: float = 2.0
    first_check_s: float = 0.25  # the first decision comes soon after start-up
    read: Callable[[set[int]], CpuSample | None] = field(default=read_sample, repr=False)

    def __post_init__(self) -> None:
        if hasattr(os, "sched_getaffinity"):
            self.cores = os.sched_getaffinity(0)
        else:
            self.cores = set(range(os.cpu_count() or 1))
        if self.max_threads is None:
            self.max_threads = callers_thread_count()
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        now = torch.get_num_threads()
        self.threads = self.max_threads if now == _set_by_policy else min(self.max_threads, now)
        if self.threads != now:
            set_threads(self.threads)
        self.others = 0.0
        self._sample = self.read(self.cores)
        self._next_check = time.monotonic() + self.first_check_s

    def choose(self, others: float) -> int:
        """Threads for this many cores used by others."""
        idle = len(self.cores) - int(others + 0.5)
        return max(1, min(self.max_threads, idle))

    def maybe_update(self) -> int:
        """Re-check if it is time (cheap otherwise); returns the thread count in force."""
        now = time.monotonic()
        if now < self._next_check or self._sample is None:
            return self.threads
        sample = self.read(self.cores)
        if sample is None:
            return self.threads
        self.others = cores_used_by_others(self._sample, sample, len(self.cores))
        self._sample, self._next_check = sample, now + self.check_every_s
        threads = self.choose(self.others)
        if threads != self.threads:
            set_threads(threads)
            self.threads = threads
        return self.threads
