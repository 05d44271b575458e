"""The compiled kernels under a memory checker: builds them with AddressSanitizer, UBSan and
bounds-checked vectors (fast/kernels.py, ``STEP14_SANITIZE=address``), then runs the kernel
sweep and the long-context engine tests with libasan loaded first, as ASan needs.

    python -m tools.sanitize [extra pytest arguments]

Clean: pytest passes and the sanitizers reported nothing (any report ends the process with
an error). The checked build has its own name, so it never replaces the regular one. Masked
AVX-512 loads and stores are not instrumented by GCC's ASan: the kernels' boundary checks
(fast/csrc/checks.h and each entry point) are what keeps those in bounds.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

TESTS = ["tests/test_kernel_sweep.py", "tests/test_long_context.py", "tests/test_attention_kinds.py",
         "tests/test_kernel_limits.py", "tests/test_layer_glue.py", "tests/test_small_linear.py",
         "tests/test_int8.py", "tests/test_block_formats.py", "tests/test_decode_layer.py"]
# tests/test_balanced_split.py runs clean here too (python -m tools.sanitize tests/test_balanced_split.py),
# but at 3 and 5 threads on a 2-core box its spinning OpenMP teams take minutes under ASan: not in
# every run, where CI's time is bounded.


def runtime(name: str) -> str:
    """The compiler's copy of a runtime library (libasan.so), as a path."""
    compiler = os.environ.get("CXX", "c++")
    path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not os.path.isabs(path):
        raise SystemExit(f"{compiler} has no {name}: install the compiler's sanitizer runtime (libasan)")
    return path


def sanitized_env() -> dict:
    # libstdc++ with it: ASan intercepts C++ throws (a kernel's TORCH_CHECK) only if the C++
    # runtime is there at start-up, which Python itself does not load.
    preload = f"{runtime('libasan.so')} {runtime('libstdc++.so')}"
    env = dict(os.environ, STEP14_SANITIZE="address", LD_PRELOAD=preload,
               # Python's own allocations are not ours to audit: leaks off; any error ends the run.
               ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    return env


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    # -n 0: one process, so a sanitizer report is printed where it happened.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          *TESTS, *args], env=sanitized_env())
    verdict = "clean" if run.returncode == 0 else f"NOT clean (exit {run.returncode})"
    print(f"sanitizer run: {verdict} in {time.perf_counter() - started:.0f} s "
          f"(ASan + UBSan + bounds-checked vectors; {len(TESTS)} test files)")
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
