"""The CPU thread policy: threads = the cores other processes leave idle, at least one."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from internals.cpu_threads import CpuSample, ThreadPolicy, cores_used_by_others


@pytest.fixture(autouse=True)
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_others_are_busy_time_minus_our_own():
    before = CpuSample(total=1000, busy=100, own=50)
    # 2 cores for 100 ticks each: 150 busy ticks, 60 of them ours -> others kept 0.9 core busy
    after = CpuSample(total=1200, busy=250, own=110)
    assert cores_used_by_others(before, after, num_cores=2) == pytest.approx(0.9)
    assert cores_used_by_others(before, before, num_cores=2) == 0.0


def test_choose_leaves_the_busy_cores_and_keeps_one():
    policy = ThreadPolicy(max_threads=8)
    policy.cores = {0, 1, 2, 3}
    assert policy.choose(0.0) == 4
    assert policy.choose(0.4) == 4  # a core counts as taken from half of it
    assert policy.choose(0.6) == 3
    assert policy.choose(3.9) == 1
    assert policy.choose(7.0) == 1
    assert ThreadPolicy(max_threads=2).choose(0.0) <= 2


def test_max_threads_defaults_to_torchs_setting_and_is_validated():
    torch.set_num_threads(1)
    assert ThreadPolicy().max_threads == 1
    with pytest.raises(ValueError, match="max_threads"):
        ThreadPolicy(max_threads=0)


def test_a_busy_neighbour_is_seen_and_its_core_given_up():
    policy = ThreadPolicy(max_threads=64, first_check_s=0.0)
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.6)
        threads = policy.maybe_update()
    finally:
        neighbour.kill()
        neighbour.wait()
    assert policy.others >= 0.5  # the spinning process alone keeps at least half a core busy
    assert threads == torch.get_num_threads() == policy.choose(policy.others)
    assert threads <= max(1, len(policy.cores) - 1)  # the neighbour's core is not computed on
    assert policy.maybe_update() == threads  # not due yet: no re-check, nothing changes
