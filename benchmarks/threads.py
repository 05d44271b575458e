"""Thread configurations, and the busy neighbour.

A configuration is a label: ``default`` leaves every system at its own default (ours: the
engine's thread policy; vLLM: its default CPU binding); a number N gives our process N torch
intra-op threads and binds vLLM's OpenMP compute threads to cores 0..N-1.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys

import torch

DEFAULT = "default"
# torch's own default, taken at import: the engine's thread policy may leave torch's
# process-wide count lowered after a run, and the next system must not inherit that.
INITIAL_THREADS = torch.get_num_threads()


def parse_thread_configs(text: str) -> list[str]:
    """``"default,1"`` -> ["default", "1"]; anything else than default or a count >= 1 is refused."""
    configs = [c.strip() for c in text.split(",") if c.strip()]
    if not configs:
        raise ValueError("--threads needs at least one configuration (e.g. default,1)")
    for c in configs:
        if c != DEFAULT and not (c.isdigit() and int(c) >= 1):
            raise ValueError(f"--threads: {c!r} is neither 'default' nor a thread count >= 1")
    return configs


@contextlib.contextmanager
def torch_threads(config: str):
    """Run the body with the configuration's torch intra-op threads (default: torch's own
    default, as at import), then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(INITIAL_THREADS if config == DEFAULT else int(config))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def vllm_env(config: str) -> dict[str, str]:
    """Environment for vLLM's process: nothing for its default binding, else cores 0..N-1."""
    if config == DEFAULT:
        return {}
    n = int(config)
    return {"VLLM_CPU_OMP_THREADS_BIND": "0" if n == 1 else f"0-{n - 1}"}


@contextlib.contextmanager
def busy_neighbour():
    """One other CPU-bound process (a Python busy loop) for the duration of the body."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()  # only the process started above, by its handle
        proc.wait()
