"""AsyncLLM's pause as its caller relies on it (issue 53): ``pause_generation`` returns only
once no step runs and every output of the steps before it is in its stream's queue, in every
mode ("keep", "wait", "abort"), and ``sleep(level=0)`` likewise; ``resume_generation`` lets
kept requests go on with the tokens an unpaused run gives.

vLLM's offline pause/resume example, repeated: streams run, a task pauses, and between the
pause's return and the resume no output may reach any stream (what the streams read plus what
their queues hold at the return is all they get until the resume) and no step may run; after
the resume the greedy tokens equal an unpaused run's. No timing asserts: the hold only gives a
step that pause failed to wait for the time to show itself. Where the step thread must be
exactly somewhere (a step under way, a prefill half done), a gate holds it right after a step,
before it hands the step back. Then the edges: pause from inside a step, pause when idle,
twice, resume without pause, a dead engine; and the offline LLM's sleep(level=0)."""
from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from engine import AsyncLLM, EngineDeadError
from helpers import greedy, make_llm, random_prompt, sequence_of

ROUNDS = 20          # per mode: vLLM's check, again and again
NUM_STREAMS = 3
MAX_TOKENS = 8
LONG_PROMPT = 128    # at 8 tokens a step: a prefill of many steps
BUDGET = 8
HOLD_S = 0.05        # paused: a step that pause did not wait for lands in this time
WAIT_S = 60          # only ends a hung test


def prompts(seed: int) -> list[list[int]]:
    """One long prompt (a prefill of several steps) and short ones; a fresh set per seed, so
    the prefix cache never shortens the long prefill."""
    return [random_prompt(LONG_PROMPT, 100 * seed)] + [
        random_prompt(4 + i, 100 * seed + i) for i in range(1, NUM_STREAMS)]


@pytest.fixture(scope="module")
def reference(llama_dir):
    """``reference(seed)``: the greedy tokens of an unpaused run of ``prompts(seed)``."""
    llm = make_llm(llama_dir, max_num_batched_tokens=BUDGET)
    return functools.cache(lambda seed: [o.outputs[0].token_ids for o in llm.generate(
        prompts(seed), greedy(MAX_TOKENS), use_tqdm=False)])


@pytest.fixture(scope="module")
def shared_engine(llama_dir):
    engine = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                      max_num_batched_tokens=BUDGET)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(shared_engine):
    """The module's engine; a failed test leaves it neither paused nor busy for the next."""
    yield shared_engine
    asyncio.run(shared_engine.resume_generation())
    core = shared_engine.llm_engine.engine_core
    shared_engine.llm_engine.abort_request(list(core.output_processor.requests))


class Streams:
    """The example's generator task, one per prompt: each counts the outputs it read."""

    def __init__(self, engine: AsyncLLM, seed: int) -> None:
        self.engine, self.read = engine, [0] * NUM_STREAMS
        self.ids = [f"s{seed}-{i}" for i in range(NUM_STREAMS)]
        self.last = [None] * NUM_STREAMS
        self.tasks = [asyncio.create_task(self._stream(i, p)) for i, p in enumerate(prompts(seed))]

    async def _stream(self, i: int, prompt: list[int]) -> None:
        async for out in self.engine.generate({"prompt_token_ids": prompt}, greedy(MAX_TOKENS),
                                              self.ids[i]):
            self.read[i] += 1
            self.last[i] = out

    def handed(self) -> int:
        """Outputs that reached the streams: read, or waiting in their queues."""
        sinks = self.engine._steps.sinks
        return sum(self.read) + sum(sinks[r].queue.qsize() for r in self.ids if r in sinks)

    async def finish(self) -> list[list[int]]:
        await asyncio.gather(*self.tasks)
        return [out.outputs[0].token_ids for out in self.last]


async def hold_paused(engine: AsyncLLM, streams: Streams) -> None:
    """Just paused: nothing reaches a stream and no step runs until the resume."""
    handed, steps = streams.handed(), engine.llm_engine.steps
    await asyncio.sleep(HOLD_S)  # the streams read their queues; a stray step would land
    assert streams.handed() == sum(streams.read) == handed, "an output arrived while paused"
    assert engine.llm_engine.steps == steps, "a step ran while paused"
    assert await engine.is_paused()
    await engine.resume_generation()


def check_tokens(mode: str, tokens: list[list[int]], reference: list[list[int]]) -> None:
    if mode == "abort":  # an aborted stream ends with what it had: a prefix of the reference
        assert all(t == ref[:len(t)] for t, ref in zip(tokens, reference))
    else:
        assert tokens == reference


def long_prompt_computed(engine: AsyncLLM, streams: Streams) -> int | None:
    seq = sequence_of(engine.llm_engine, streams.ids[0])
    return None if seq is None else seq.num_computed_tokens


async def pause_lands(engine: AsyncLLM, streams: Streams, r: int) -> None:
    """Wait for round ``r``'s moment to pause: at once (the requests wait at the door), once
    the long prompt's prefill has begun, or after some outputs were read (decoding)."""
    def ready() -> bool:
        if r % 3 == 0:
            return True
        if r % 3 == 1:
            return bool(long_prompt_computed(engine, streams))
        return sum(streams.read) > r % MAX_TOKENS
    while not ready() and not all(t.done() for t in streams.tasks):
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_nothing_reaches_a_stream_between_pause_and_resume(engine, reference, mode):
    async def one_round(r: int) -> None:
        seed = 1000 * "keep wait abort".split().index(mode) + r
        streams = Streams(engine, seed)
        await pause_lands(engine, streams, r)
        if r % 2:
            await engine.sleep(level=0, mode=mode)
        else:
            await engine.pause_generation(mode=mode)
        await hold_paused(engine, streams)
        check_tokens(mode, await streams.finish(), reference(seed))
        assert engine.get_num_unfinished_requests() == 0

    async def rounds() -> None:
        for r in range(ROUNDS):
            await one_round(r)
    asyncio.run(rounds())
    assert not engine.errored


class Gate:
    """Holds the step thread right after the first step that makes ``when()`` true, before
    the thread hands the step back: a step under way, for as long as the test likes."""

    def __init__(self, engine: AsyncLLM, when) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.llm_engine = engine.llm_engine
        inner = engine.llm_engine.step

        def step():
            outputs = inner()
            if not self.reached.is_set() and when():
                self.reached.set()
                self.go.wait(WAIT_S)
            return outputs
        self.llm_engine.step = step

    def open(self) -> None:
        self.go.set()
        vars(self.llm_engine).pop("step", None)


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_pause_waits_for_the_step_under_way_mid_prefill(engine, reference, mode):
    seed = 5000 + "keep wait abort".split().index(mode)
    long_id = f"s{seed}-0"

    def mid_prefill() -> bool:
        seq = sequence_of(engine.llm_engine, long_id)
        return seq is not None and 0 < seq.num_computed_tokens < LONG_PROMPT

    gate = Gate(engine, mid_prefill)

    async def scenario() -> None:
        streams = Streams(engine, seed)
        assert await asyncio.to_thread(gate.reached.wait, WAIT_S)
        pause = asyncio.create_task(engine.pause_generation(mode=mode))
        await asyncio.sleep(HOLD_S)
        assert not pause.done(), "pause returned while a step was under way"
        gate.open()
        await pause
        if mode == "keep":  # frozen halfway through the long prompt's prefill
            assert mid_prefill() and streams.read[0] == 0
        await hold_paused(engine, streams)
        check_tokens(mode, await streams.finish(), reference(seed))
    try:
        asyncio.run(scenario())
    finally:
        gate.open()


def test_pause_from_inside_a_step_idle_twice_and_resume_without_pause(engine, reference):
    seed = 6000
    paused_inside = threading.Event()

    def pause_inside() -> bool:  # a hook on the step thread: it cannot wait for itself
        asyncio.run(engine.pause_generation(mode="keep"))
        return paused_inside.set() or True

    async def scenario() -> None:
        await engine.resume_generation()  # without a pause: nothing happens
        await engine.pause_generation(mode="keep")  # idle: returns at once
        await engine.pause_generation(mode="keep")  # twice
        assert await engine.is_paused()
        await engine.resume_generation()
        await engine.resume_generation()
        assert not await engine.is_paused()
        gate = Gate(engine, lambda: engine.llm_engine.steps > 0 and pause_inside())
        try:
            streams = Streams(engine, seed)
            assert await asyncio.to_thread(gate.reached.wait, WAIT_S) and paused_inside.is_set()
        finally:
            gate.open()
        await engine.pause_generation(mode="keep")  # already frozen: waits for that step only
        await hold_paused(engine, streams)
        assert await streams.finish() == reference(seed)
    asyncio.run(scenario())


def test_pause_on_a_dead_engine_is_engine_dead_error(llama_dir):
    engine = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        def hash_fn(data, prev):
            raise RuntimeError("hash_fn broke")
        engine.llm_engine.prefix_cache.hash_fn = hash_fn

        async def scenario() -> None:
            with pytest.raises(EngineDeadError):
                await Streams(engine, 7000).finish()
            for mode in ("keep", "wait", "abort"):
                with pytest.raises(EngineDeadError):
                    await engine.pause_generation(mode=mode)
            await engine.resume_generation()  # nothing to resume: no error, no hang
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_llm_sleep_waits_for_a_step_another_thread_runs(llama_dir):
    llm = make_llm(llama_dir)
    llm.llm_engine.engine_core.lock.acquire()  # another thread's step, under way
    try:
        sleeper = threading.Thread(target=llm.sleep, kwargs=dict(level=0, mode="keep"))
        sleeper.start()
        sleeper.join(HOLD_S)
        assert sleeper.is_alive() and not llm.is_sleeping()
    finally:
        llm.llm_engine.engine_core.lock.release()
    sleeper.join(WAIT_S)
    assert not sleeper.is_alive() and llm.is_sleeping()
    llm.wake_up()
