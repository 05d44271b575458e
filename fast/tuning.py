"""CPU process tuning as one object the entry points apply: glibc keeps freed memory for the
next step's tensors (cpu_memory.py), and torch computes with the cores other processes leave
idle, re-checked every few seconds between steps (cpu_threads.py).

    tuning = CpuTuning(max_threads=None)  # an entry point (the vLLM layer, the bench) builds it
    tuning.apply()                        # once: the process settings
    tuning.maybe_update()                 # before each step (FastBackend.before_step)

Nothing in the core changes the process: an engine built from parts without this runs with
the process exactly as its caller set it up.
"""
from __future__ import annotations

from fast import cpu_memory
from fast.cpu_threads import ThreadPolicy


class CpuTuning:
    def __init__(self, max_threads: int | None = None) -> None:
        self.max_threads = max_threads
        self.threads: ThreadPolicy | None = None
        self.keeps_freed_memory = False

    def apply(self) -> None:
        self.keeps_freed_memory = cpu_memory.keep_freed_memory()
        self.threads = ThreadPolicy(max_threads=self.max_threads)

    def maybe_update(self) -> None:
        if self.threads is not None:
            self.threads.maybe_update()  # rate-limited: reads /proc every few seconds

    def describe(self) -> str:
        threads = self.threads.threads if self.threads else "as the caller set them"
        return f"threads {threads}, kept memory {'on' if self.keeps_freed_memory else 'off'}"
