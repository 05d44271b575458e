"""fast/cpu_memory.py: the process memory settings on CPU change where bytes live, never
a result. Checked: the huge-page buffers are what torch.zeros/empty would give (shape, dtype,
zeros) and start on a huge-page boundary; the settings take on Linux with glibc; and an
engine in this process, with them set, and one in a fresh process without them (they are
process-wide) give the same greedy tokens."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from fast import cpu_memory

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_huge_pages_are_zeros_on_a_huge_page_boundary(dtype):
    shape = (3, 5 * cpu_memory.HUGE_PAGE // 64 + 7, 16)  # several huge pages, not a whole number
    pool = cpu_memory.zeros_on_huge_pages(shape, dtype, CPU)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    assert pool.data_ptr() % cpu_memory.HUGE_PAGE == 0
    pool[-1, -1, -1] = 1  # the whole view is writable memory of its own
    assert pool.sum() == 1


def test_small_buffers_are_plain_tensors():
    small = cpu_memory.zeros_on_huge_pages((4, 8), torch.float32, CPU)
    assert small.shape == (4, 8) and torch.count_nonzero(small) == 0


def test_settings_take_on_linux_with_glibc():
    assert cpu_memory.keep_freed_memory() is GLIBC


GENERATE = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=64, block_size=4)
outs = llm.generate([list(range(3, 40)), list(range(5, 20))],
                    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_tokens_equal_with_and_without_the_settings(llama_dir):
    namespace = {"__name__": "generate"}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), mock.patch.object(sys, "argv", ["-c", llama_dir]):
        exec(GENERATE, namespace)  # here, where an engine has set them (fast/tuning.py)
    assert cpu_memory.keep_freed_memory() is GLIBC
    env = dict(os.environ, STEP14_TUNE_CPU_MEMORY="0", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", GENERATE, llama_dir], env=env,
                          capture_output=True, text=True, check=True)
    on = json.loads(stdout.getvalue().strip().splitlines()[-1])
    off = json.loads(done.stdout.strip().splitlines()[-1])
    assert on == off and len(on) == 2 and all(len(t) == 12 for t in on)
