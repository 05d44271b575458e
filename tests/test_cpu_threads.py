"""The CPU thread policy: threads = the cores other processes leave idle, at least one."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from fast.cpu_threads import CpuSample, ThreadPolicy, cores_used_by_others, read_sample


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
    """Samples as /proc would give them: another process keeps one of our cores busy."""
    samples = iter([CpuSample(total=0, busy=0, own=0),
                    CpuSample(total=200, busy=180, own=80)])  # 2 cores x 100 ticks: others 1.0
    policy = ThreadPolicy(max_threads=2, first_check_s=0.0, read=lambda cores: next(samples))
    policy.cores = {0, 1}
    threads = policy.maybe_update()
    assert policy.others == pytest.approx(1.0)
    assert threads == torch.get_num_threads() == 1  # the neighbour's core is not computed on
    assert policy.maybe_update() == 1  # not due yet: no re-check (no third sample is read)


def test_the_real_counters_read_on_linux():
    sample = read_sample(set(range(os.cpu_count() or 1)))
    if sys.platform.startswith("linux"):
        assert sample is not None and sample.total >= sample.busy >= 0 and sample.own >= 0
    else:
        assert sample is None
