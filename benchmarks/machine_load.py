"""The machine's load beside each timed run: how many cores *other* processes kept busy.

Every system here is CPU-bound, so a figure means little without the load it was taken under.
``others_cores`` = (CPU time the whole machine spent busy - CPU time of this process and its
waited-for children) / wall time, from ``/proc/stat`` and ``getrusage``; ``loadavg_1m`` is the
1-minute load average at the start. Where ``/proc/stat`` is missing (not Linux) both are None.
"""
from __future__ import annotations

import contextlib
import os
import resource
import time


def machine_busy_s() -> float | None:
    """Seconds of CPU time all cores have spent busy since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def loadavg_1m() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


@contextlib.contextmanager
def measure_load():
    """Yields a dict filled at exit: others_cores, loadavg_1m, cpus."""
    load: dict = dict(loadavg_1m=loadavg_1m(), cpus=os.cpu_count(), others_cores=None)
    busy0, own0, t0 = machine_busy_s(), own_cpu_s(), time.perf_counter()
    yield load
    busy1, own1, wall = machine_busy_s(), own_cpu_s(), time.perf_counter() - t0
    if busy0 is not None and busy1 is not None and wall > 0:
        load["others_cores"] = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall


def describe(load: dict | None) -> str:
    if not load or load.get("others_cores") is None:
        return "n/a"
    return f"{load['others_cores']:.1f} of {load['cpus']}"
