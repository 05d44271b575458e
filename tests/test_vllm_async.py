"""AsyncLLM as RL and serving code drives it: one client's closed event loop loses only its
own stream; any BaseException in a step (SystemExit from a user's hash_fn) is EngineDeadError
to every stream and to check_health(); a dropped AsyncLLM is freed; output_processor,
data_parallel_rank, pause / resume / sleep(level=0), collective_rpc; LLM's pause and resume
as vLLM's offline example uses them (sleep(level=0) / wake_up(tags=["scheduling"]))."""
from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest

from engine import AsyncLLM, EngineDeadError, VLLMValidationError
from helpers import greedy, make_llm, random_prompt
from vllm_api.errors import UnsupportedFeatureError


def async_llm(llama_dir, **overrides) -> AsyncLLM:
    return AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=64, **overrides)


async def collect(engine, prompt, params, request_id, **kwargs):
    return [out async for out in engine.generate({"prompt_token_ids": prompt}, params,
                                                  request_id, **kwargs)]


def wait_until(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll for a state the stepping thread reaches; the limit only ends a hung test."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.01)


def test_a_client_whose_loop_closed_loses_only_its_own_stream(llama_dir):
    engine = async_llm(llama_dir)
    try:
        lost_loop = asyncio.new_event_loop()
        stream = engine.generate({"prompt_token_ids": random_prompt(9, 1)}, greedy(300), "gone")
        first = lost_loop.run_until_complete(stream.__anext__())
        assert not first.finished
        lost_loop.close()  # the client vanished mid-stream, its generator never closed
        outputs = asyncio.run(collect(engine, random_prompt(7, 2), greedy(5), "other"))
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
        assert not engine.errored
        wait_until(lambda: engine.get_num_unfinished_requests() == 0, "the lost request aborted")
        assert engine.llm_engine.stats()["blocks_in_use"] == 0
        asyncio.run(engine.check_health())
    finally:
        engine.shutdown()


def test_a_base_exception_in_a_step_is_engine_dead_error_everywhere(llama_dir):
    engine = async_llm(llama_dir)
    try:
        def hash_fn(data, prev):  # a user's hash function that exits
            raise SystemExit("hash_fn gave up")
        engine.llm_engine.prefix_cache.hash_fn = hash_fn

        async def two_streams():
            return await asyncio.gather(
                *(collect(engine, random_prompt(20, 3 + i), greedy(4), f"r{i}") for i in range(2)),
                return_exceptions=True)
        results = asyncio.run(two_streams())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert isinstance(results[0].__cause__, SystemExit)
        assert "EngineCore encountered an issue" in str(results[0])
        assert engine.errored and not engine.is_running and engine.dead_error is results[0]
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.check_health())
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, random_prompt(5, 9), greedy(2), "late"))
    finally:
        engine.shutdown()


def test_an_async_llm_dropped_without_shutdown_is_freed(llama_dir):
    engine = async_llm(llama_dir)
    asyncio.run(collect(engine, random_prompt(6, 4), greedy(3), "once"))
    inner, thread = weakref.ref(engine.llm_engine), engine._steps.thread
    del engine
    gc.collect()
    thread.join(timeout=60)
    gc.collect()
    assert not thread.is_alive() and inner() is None


def test_output_processor_and_data_parallel_rank(llama_dir):
    engine = async_llm(llama_dir)
    try:
        assert engine.output_processor.get_num_unfinished_requests() == 0
        assert not engine.output_processor.has_unfinished_requests()
        outputs = asyncio.run(collect(engine, random_prompt(6, 5), greedy(3), "dp",
                                      data_parallel_rank=0))
        assert outputs[-1].finished
        with pytest.raises(VLLMValidationError, match=r"data_parallel_rank 1 is out of range \[0, 1\)"):
            asyncio.run(collect(engine, random_prompt(6, 5), greedy(3), "dp1", data_parallel_rank=1))
        assert engine.get_num_unfinished_requests() == 0
    finally:
        engine.shutdown()


def test_pause_holds_new_requests_until_resume(llama_dir):
    engine = async_llm(llama_dir)
    try:
        async def scenario():
            await engine.pause_generation(mode="keep")
            assert await engine.is_paused() and await engine.is_sleeping()
            held = asyncio.create_task(collect(engine, random_prompt(6, 6), greedy(3), "held"))
            await asyncio.sleep(0.05)
            assert not held.done() and engine.get_num_unfinished_requests() == 0
            await engine.resume_generation()
            outputs = await held
            assert not await engine.is_paused()
            return outputs
        assert asyncio.run(scenario())[-1].finished
    finally:
        engine.shutdown()


def test_pause_abort_ends_running_streams_and_sleep_zero_is_the_pause(llama_dir):
    engine = async_llm(llama_dir)
    try:
        async def scenario():
            running = asyncio.create_task(collect(engine, random_prompt(6, 7), greedy(400), "run"))
            while engine.get_num_unfinished_requests() == 0:
                await asyncio.sleep(0.01)
            await engine.pause_generation(mode="abort")
            outputs = await running
            assert outputs[-1].outputs[0].finish_reason == "abort"
            await engine.wake_up(tags=["scheduling"])
            await engine.sleep(level=0)
            assert await engine.is_paused()
            assert await engine.wake_up() is True and not await engine.is_paused()
            with pytest.raises(UnsupportedFeatureError, match="sleep mode"):
                await engine.sleep(level=1)
            with pytest.raises(ValueError, match="Invalid pause mode"):
                await engine.pause_generation(mode="later")
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_collective_rpc_reaches_the_worker_from_async_llm(llama_dir):
    engine = async_llm(llama_dir)
    try:
        result = asyncio.run(engine.collective_rpc(
            lambda worker: sum(p.numel() for p in worker.model_runner.model.parameters())))
        assert result == [sum(p.numel() for p in engine.llm_engine.model.parameters())]
    finally:
        engine.shutdown()


def test_llm_pause_and_resume_as_vllms_offline_example(llama_dir):
    llm = make_llm(llama_dir)
    prompt = random_prompt(8, 8)
    (expected,) = llm.generate([prompt], greedy(4), use_tqdm=False)
    llm.sleep(level=0)
    assert llm.is_sleeping()
    request_id = llm.add_request(prompt, greedy(4))
    assert llm.step() == [] and llm.has_unfinished_requests()  # accepted, not scheduled
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate([prompt], greedy(4), use_tqdm=False)
    assert llm.wake_up(tags=["scheduling"]) is True and not llm.is_sleeping()
    finished = []
    while llm.has_unfinished_requests():
        finished += llm.step()
    assert [o.request_id for o in finished] == [request_id]
    assert finished[0].outputs[0].token_ids == expected.outputs[0].token_ids
    llm.add_request(prompt, greedy(400))
    llm.step()
    llm.sleep(level=0, mode="abort")  # abort: the running request goes
    llm.wake_up()
    assert not llm.has_unfinished_requests() or all(o.finished for o in llm.step())
    with pytest.raises(UnsupportedFeatureError, match="sleep mode"):
        llm.sleep(level=1)
