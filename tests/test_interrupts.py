"""A Ctrl-C at any line of the engine's bookkeeping loses nothing and commits nothing half.

Every step of a workload that admits, hits the prefix cache, waits for a block in flight,
saves twins, evicts, preempts, samples n > 1 and finishes is run again and again with SIGINT
sent at a line of the engine's own files (line_faults.py): at the first time each distinct
line runs in that step, and, for the richest step, at every line it runs. After each
interrupt the step either happened whole (the engine's whole bookkeeping, ``fingerprint``, is
what the same step leaves on an engine without interrupts) or committed nothing: no sequence
advanced, no token, no output, only what the plan had to do before its forward (a preemption,
an eviction). The block accounting holds either way, and the same step then run without
interrupt leaves exactly what it leaves on the engine without interrupts; the workload gives
the same tokens. ``LLM.generate`` gets the same sweep over its whole call (intake, steps,
clean-up): after each interrupt nothing may be queued or held, and the next call must answer
correctly.
"""
from __future__ import annotations

import pytest

from engine import SamplingParams
from helpers import add, assert_no_leak, greedy, make_core, make_llm, random_prompt
from invariants import assert_idle, check_accounting
from line_faults import LineFault, first_occurrences, fingerprint

PREFIX = random_prompt(12, seed=70)


def workload_requests() -> list[tuple[list[int], SamplingParams]]:
    """Shared prefixes, a copy in flight, a prompt-logprobs request that saves a twin, n = 2,
    seeded sampling, logprobs; the pool is too small for all of them at once."""
    return [
        (PREFIX + random_prompt(3, 71), greedy(10)),
        (PREFIX + random_prompt(3, 71), greedy(4)),                      # waits, then hits
        (PREFIX + random_prompt(5, 72), greedy(3, prompt_logprobs=1)),   # reads no cache: a twin
        (PREFIX[:8] + random_prompt(6, 73), SamplingParams(n=2, temperature=0.8, seed=5,
                                                           max_tokens=4, logprobs=2)),
        (random_prompt(8, 74), greedy(16)),
        (random_prompt(7, 75), greedy(16)),
    ]


def new_core():
    """A pool too small for the workload at once. The plain backend: the bookkeeping is the
    same with either, and its forward is the cheaper one at this size."""
    return make_core(PREFIX_DIR[0], fast_paths=False, block_size=4, num_kv_blocks=10,
                     max_num_batched_tokens=12, max_num_seqs=4)


PREFIX_DIR: list[str] = []  # the llama checkpoint, set by the fixture below


@pytest.fixture(autouse=True)
def _checkpoint(llama_dir):
    PREFIX_DIR[:] = [llama_dir]


def start(core) -> list[str]:
    return [add(core, prompt, params, request_id=f"r{i}") for i, (prompt, params) in
            enumerate(workload_requests())]


def run_clean() -> tuple[dict, list[list[tuple[str, int]]]]:
    """The workload without interrupts: outputs by id, and the traced lines of each step."""
    core, outputs, per_step = new_core(), {}, []
    start(core)
    while core.has_unfinished:
        with LineFault() as trace:
            outs = core.step()
        per_step.append(trace.lines)
        outputs.update((o.request_id, o) for o in outs)
    return outputs, per_step


def interrupt_at(core, k: int, done: dict) -> list | None:
    """One step with a Ctrl-C at its k-th traced line. Either it committed nothing (None) or,
    interrupted only after its commit, it happened whole (as ``done``, the same step on an
    engine without interrupts): then its outputs."""
    before = fingerprint(core)
    with LineFault(k) as fault:
        try:
            return core.step()  # k is past the step's last line: it ran whole, uninterrupted
        except KeyboardInterrupt:
            assert fault.fired
    check_accounting(core)
    outputs = core.stream.drain()  # a finished step's outputs wait for the next call
    if fingerprint(core, times=False) == done:
        return outputs
    assert not outputs
    assert_nothing_committed(before, fingerprint(core), f"an interrupt at line {k} ({fault.lines[-1]})")
    return None


def assert_nothing_committed(before: dict, after: dict, what: str) -> None:
    """No token, output or progress: each sequence as it was, or preempted (sent back to wait,
    its blocks freed) by the plan; the request records and the counters of steps unchanged."""
    assert after["requests"] == before["requests"], f"{what}: a request record changed"
    assert (after["steps"], after["generation_tokens"], after["stream"]) == \
        (before["steps"], before["generation_tokens"], before["stream"]), f"{what}: a step was counted"
    for rid, seq in after["seqs"].items():
        was = before["seqs"][rid]
        preempted = seq[2] == 0 and seq[3] == [] and seq[4].value == "waiting"
        assert seq[:2] == was[:2] and (seq[2:5] == was[2:5] or preempted), f"{what}: {rid} advanced"
    for old, new in zip(before["blocks"], after["blocks"]):
        assert new[1] == old[1], f"{what}: a block was taken (its generation moved)"


def run_with_interrupts(points_of_step) -> tuple[dict, int, int]:
    """The workload, each step first interrupted at ``points_of_step(n)``; beside it the same
    workload without interrupts, step for step, says what a whole step leaves. Returns the
    outputs, the interrupts that left their step uncommitted, and the points left out because
    the step they were in had already happened whole (a Ctrl-C in its commit lands at its end)."""
    core, clean, outputs, injected, n, total = new_core(), new_core(), {}, 0, 0, 0
    uncommitted = 0
    start(core)
    start(clean)
    while clean.has_unfinished:
        clean.step()
        done = fingerprint(clean, times=False)
        outs, points = None, list(points_of_step(n))
        total += len(points)
        for k in points:
            injected += 1
            outs = interrupt_at(core, k, done)
            if outs is not None:
                break  # it happened: later lines would only interrupt it later still
            uncommitted += 1
        if outs is None:
            outs = core.step()
        outputs.update((o.request_id, o) for o in outs)
        assert fingerprint(core, times=False) == done
        n += 1
    assert_idle(core)
    return outputs, uncommitted, total - injected


def assert_same_outputs(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for rid, out in expected.items():
        assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in out.outputs], rid
        assert got[rid].prompt_logprobs == out.prompt_logprobs


def test_the_workload_covers_the_bookkeeping():
    """Twin, in-flight wait, eviction, preemption and finishing all happen in the workload."""
    _, per_step = run_clean()
    ran = {line for lines in per_step for line in lines}
    functions = _function_lines()
    for name in ("_switch_to_twin", "preempt", "evict", "_is_in_flight", "finish", "retain"):
        assert ran & functions[name], f"the workload never ran {name}"


def test_an_interrupt_at_each_distinct_line_of_the_workload_changes_nothing():
    """Every line the workload's steps run, interrupted the first time it runs."""
    expected, per_step = run_clean()
    points = first_in_workload(per_step)
    got, uncommitted, after_the_work = run_with_interrupts(lambda n: points.get(n, []))
    assert_same_outputs(got, expected)
    distinct = len({line for lines in per_step for line in lines})
    # about half the lines are planning and the forward (the step is left uncommitted), half the
    # commit (a Ctrl-C there lands at the step's end: the step happened whole)
    assert distinct > 250 and uncommitted > 250 and after_the_work > 100


def first_in_workload(per_step: list[list]) -> dict[int, list[int]]:
    """step -> the positions in it of lines that run there for the first time in the workload."""
    seen, points = set(), {}
    for n, lines in enumerate(per_step):
        for k, line in enumerate(lines, 1):
            if line not in seen:
                seen.add(line)
                points.setdefault(n, []).append(k)
    return points


@pytest.mark.parametrize("which", ["first", "densest"])
def test_an_interrupt_at_every_line_of_a_step_changes_nothing(which):
    """Every line of one step, each interrupted in turn: the first step (admissions, lookups,
    the in-flight wait, the first saves), and the step that runs the most distinct lines for
    the lines it runs."""
    expected, per_step = run_clean()
    chosen = 0 if which == "first" else max(range(len(per_step)),
                                            key=lambda n: len(set(per_step[n])) / len(per_step[n]))
    every = range(1, len(per_step[chosen]) + 1)
    got, uncommitted, after_the_work = run_with_interrupts(lambda n: every if n == chosen else [])
    assert_same_outputs(got, expected)
    assert len(every) > 400 and uncommitted > 250 and after_the_work > 100


def test_generate_interrupted_at_each_distinct_line_leaves_nothing(llama_dir, reference):
    """Intake, steps and clean-up of one generate() call (from an empty cache each time):
    after an interrupt at any line, no request is left, no block held, and the next call
    answers as Hugging Face does."""
    llm = make_llm(llama_dir, fast_paths=False, block_size=4, num_kv_blocks=24,
                   max_num_batched_tokens=12)
    prompts = [PREFIX + random_prompt(3, 80), PREFIX + random_prompt(3, 80), random_prompt(9, 81)]
    check = random_prompt(6, 82)
    llm.generate(prompts, greedy(3), use_tqdm=False)  # first-call set-up runs once: not in the count
    llm.reset_prefix_cache()
    with LineFault() as trace:
        llm.generate(prompts, greedy(3), use_tqdm=False)
    points = first_occurrences(trace.lines)
    for k in points:
        llm.reset_prefix_cache()
        with LineFault(k) as fault:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, greedy(3), use_tqdm=False)
        assert fault.fired
        assert_idle(llm)
        assert_no_leak(llm)
        (out,) = llm.generate([check], greedy(2), use_tqdm=False)
        reference.compare(check, out.token_ids, 2, f"after an interrupt at line {k}")
    reference.compare_all(prompts, llm.generate(prompts, greedy(3), use_tqdm=False), 3)
    assert len(points) > 400


def _function_lines() -> dict[str, set]:
    """(file name, line) of each line of the functions the coverage test names."""
    import inspect

    import block_manager
    import prefix_cache
    import scheduler

    found = {}
    for module, names in ((scheduler.Scheduler, ("_switch_to_twin", "preempt", "finish")),
                          (prefix_cache.PrefixCache, ("evict", "_is_in_flight")),
                          (block_manager.BlockManager, ("retain",))):
        for name in names:
            source, first = inspect.getsourcelines(getattr(module, name))
            file = inspect.getsourcefile(module).rsplit("/", 1)[-1]
            found[name] = {(file, first + i) for i in range(1, len(source))}
    return found
