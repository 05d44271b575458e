"""Issue 51's scripts, items 1-5, as vLLM 0.32 runs them: ``get_tokenizer``, priority scheduling,
``check_health`` reading ``errored``, vLLM v1's custom logits processors, and the pre-queued
``enqueue`` / ``wait_for_completion`` path. Texts are vLLM's where its tests match on them."""
from __future__ import annotations

import asyncio
from unittest.mock import patch

import pytest
import torch

from engine import (
    AsyncLLM,
    BatchUpdate,
    EngineDeadError,
    LogitsProcessor,
    MoveDirectionality,
    SamplingParams,
    get_tokenizer,
    process_dict_updates,
)
from helpers import DEMO_MODEL_DIR, add, greedy, make_core, make_llm, random_prompt


# ---------------------------------------------------------------------------- 1. get_tokenizer

def test_get_tokenizer_is_the_engines_tokenizer():
    """lighteval builds its tokenizer with vLLM's get_tokenizer before the engine."""
    tokenizer = get_tokenizer(str(DEMO_MODEL_DIR), trust_remote_code=False, revision="main",
                              tokenizer_mode="auto")
    llm = make_llm(DEMO_MODEL_DIR)
    text = "def f(x):\n    return x"
    assert tokenizer.encode(text) == llm.get_tokenizer().encode(text)
    assert tokenizer.truncation_side == "left"  # vLLM's for generative models
    with pytest.raises(FileNotFoundError, match="no such directory"):
        get_tokenizer("/no/such/model")


# ---------------------------------------------------------------------------- 2. priority

def test_priority_orders_admission_lower_first_then_arrival():
    llm = make_llm(DEMO_MODEL_DIR, scheduling_policy="priority", max_num_seqs=1)
    prompts = ["def a", "def b", "def c", "def d"]
    outs = llm.generate(prompts, greedy(3), use_tqdm=False, priority=[2, 0, 1, 0])
    finished = [o.metrics["finished_time"] for o in outs]
    assert sorted(range(4), key=finished.__getitem__) == [1, 3, 2, 0]
    fcfs = make_llm(DEMO_MODEL_DIR, max_num_seqs=1).generate(prompts, greedy(3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]


def test_priority_needs_the_policy_and_one_value_per_prompt():
    llm = make_llm(DEMO_MODEL_DIR)
    with pytest.raises(ValueError, match="^Got priority 1 but Priority scheduling is not enabled.$"):
        llm.generate(["def a"], greedy(2), use_tqdm=False, priority=[1])
    assert llm.generate(["def a"], greedy(2), use_tqdm=False, priority=[0])  # vLLM's default
    with pytest.raises(ValueError, match="^Got priority 3 but"):
        llm.llm_engine.add_request("r", "def a", greedy(2), priority=3)
    prio = make_llm(DEMO_MODEL_DIR, scheduling_policy="priority")
    with pytest.raises(ValueError, match="The lengths of prompts and priority must be the same."):
        prio.generate(["def a", "def b"], greedy(2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_llm(DEMO_MODEL_DIR, scheduling_policy="lifo")
    assert not llm.has_unfinished_requests() and not prio.has_unfinished_requests()


@pytest.mark.parametrize("policy,victim", [("fcfs", "late"), ("priority", "early")])
def test_the_preemption_victim_is_the_last_in_priority_order(llama_dir, policy, victim):
    """Two running sequences, the pool full: fcfs preempts the last admitted; priority the one
    with the highest priority value (vLLM's max over (priority, arrival)), admitted first."""
    core = make_core(llama_dir, num_kv_blocks=4, block_size=4, scheduling_policy=policy)
    from core.submit import Request
    from core.sampling_params import RequestOutputKind
    core.add_requests([Request("early", random_prompt(4, 1), greedy(8),
                               output_kind=RequestOutputKind.FINAL_ONLY, priority=5),
                       Request("late", random_prompt(4, 2), greedy(8),
                               output_kind=RequestOutputKind.FINAL_ONLY, priority=0)])
    while core.scheduler.stats.preemptions == 0:
        core.step()
    assert [s.request_id for s in core.scheduler.waiting] == [victim]
    while core.has_unfinished:
        core.step()
    assert core.stats()["blocks_in_use"] == 0


def test_async_generate_takes_a_priority(llama_dir):
    engine = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=32,
                      scheduling_policy="priority")

    async def run():
        return [o async for o in engine.generate({"prompt_token_ids": random_prompt(5, 3)},
                                                 greedy(3), "p", priority=-2)]
    try:
        assert asyncio.run(run())[-1].finished
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------- 3. check_health

def test_check_health_raises_engine_dead_error_while_errored(llama_dir):
    """vLLM's test: healthy, then ``errored`` patched True, then healthy again."""
    engine = AsyncLLM(llama_dir, device="cpu", dtype="float32", num_kv_blocks=16)
    try:
        asyncio.run(engine.check_health())
        with patch.object(type(engine), "errored", new_callable=lambda: property(lambda s: True)):
            with pytest.raises(EngineDeadError):
                asyncio.run(engine.check_health())
        asyncio.run(engine.check_health())
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError):  # shut down: not running, so errored (as vLLM's)
        asyncio.run(engine.check_health())


# ---------------------------------------------------------------------------- 4. logits processors

class DummyLogitsProcessor(LogitsProcessor):
    """vLLM's test processor: a request with ``extra_args={"target_token": t}`` samples t."""

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: params.extra_args
                             and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class MirrorProcessor(LogitsProcessor):
    """Keeps each slot's (prompt, live output) as vLLM's batch updates say, and checks at every
    apply that slot i of the logits is that request's row (by its prompt's first token, which
    the test makes the argmax)."""

    instances: list = []

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        self.slots: dict[int, tuple] = {}
        self.checked = 0
        MirrorProcessor.instances.append(self)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.slots, batch_update, lambda p, prompt, out: (prompt, out))
        if batch_update is not None:
            assert set(self.slots) == set(range(batch_update.batch_size))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == len(self.slots)
        for slot, (prompt, out) in self.slots.items():
            assert len(out) <= 12 and logits[slot].argmax().item() == prompt[0], (slot, prompt)
            self.checked += 1
        return logits


class TrickyArgs(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        if (sampling_params.extra_args or {}).get("bad"):
            raise ValueError("TrickyArgs: extra_args 'bad' is not allowed")

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        return logits


@pytest.mark.parametrize("spec", [DummyLogitsProcessor,
                                  "test_vllm_sixth_round:DummyLogitsProcessor",
                                  "test_vllm_sixth_round.DummyLogitsProcessor"])
def test_a_custom_logits_processor_steers_only_its_requests(spec):
    llm = make_llm(DEMO_MODEL_DIR, logits_processors=[spec])
    prompts = ["def f", "class A", "import os", "x = 1"]
    targets = [None, 67, None, 98]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args=None if t is None else {"target_token": t})
              for t in targets]
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = make_llm(DEMO_MODEL_DIR).generate(prompts, greedy(6), use_tqdm=False)
    for out, alone, target in zip(outs, plain, targets):
        want = [target] * 6 if target is not None else alone.outputs[0].token_ids
        assert out.outputs[0].token_ids == want


def test_batch_updates_follow_vllms_persistent_batch(llama_dir):
    """Requests come and go at different lengths; every step the processor's own slot map
    (built only from BatchUpdate's removed / added / moved) matches the logits it is given."""
    MirrorProcessor.instances.clear()
    llm = make_llm(llama_dir, logits_processors=[MirrorProcessor], max_num_seqs=3)
    prompts = [[10 + i] + random_prompt(3 + i, i) for i in range(6)]
    bias = [SamplingParams(temperature=0.7, seed=i, max_tokens=2 + 2 * i, ignore_eos=True,
                           logit_bias={10 + i: 100.0}) for i in range(6)]
    outs = llm.generate(prompts, bias, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + 2 * i for i in range(6)]
    (processor,) = MirrorProcessor.instances
    assert processor.checked == sum(2 + 2 * i for i in range(6))


def test_processor_classes_are_checked_and_validate_params_runs_at_submission():
    with pytest.raises(ValueError, match="is not a subclass of LogitsProcessor"):
        make_llm(DEMO_MODEL_DIR, logits_processors=[object])
    with pytest.raises(ValueError, match="Failed to load LogitsProcessor plugin"):
        make_llm(DEMO_MODEL_DIR, logits_processors=["no_such_module:Nothing"])
    llm = make_llm(DEMO_MODEL_DIR, logits_processors=[TrickyArgs])
    with pytest.raises(ValueError, match="TrickyArgs: extra_args 'bad'"):
        llm.generate(["def f"], SamplingParams(max_tokens=2, extra_args={"bad": 1}),
                     use_tqdm=False)
    assert not llm.has_unfinished_requests()


class FailsOnce(DummyLogitsProcessor):
    armed = True

    def apply(self, logits):
        if FailsOnce.armed and self.req_info:
            FailsOnce.armed = False
            raise RuntimeError("processor failed once")
        return super().apply(logits)


def test_a_processor_that_raises_fails_the_step_and_the_retry_equals_an_unfailed_run():
    FailsOnce.armed = False
    clean = make_llm(DEMO_MODEL_DIR, logits_processors=[FailsOnce])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                            extra_args={"target_token": 40})
    want = [clean.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in (("def f", params), ("class A", greedy(5)))]
    FailsOnce.armed = True
    llm = make_llm(DEMO_MODEL_DIR, logits_processors=[FailsOnce])
    llm.add_request("def f", params, request_id="a")
    llm.add_request("class A", greedy(5), request_id="b")
    done, failures = {}, 0
    while llm.has_unfinished_requests():
        try:
            done.update({o.request_id: o.outputs[0].token_ids for o in llm.step()})
        except RuntimeError:
            failures += 1
    assert failures == 1 and done["a"] == want[0] == [40] * 5
    assert done["b"] == want[1]


# ---------------------------------------------------------------------------- 5. enqueue

def test_enqueue_then_wait_for_completion_equals_generate():
    llm = make_llm(DEMO_MODEL_DIR)
    prompts = ["def f", "class A", "import os"]
    ids = llm.enqueue(prompts, greedy(4))
    assert ids == [str(i) for i in range(3)] and llm.has_unfinished_requests()
    more = llm.enqueue("x = 1", greedy(2))
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids + more
    assert all(o.finished for o in outs) and not llm.has_unfinished_requests()
    again = llm.generate(prompts + ["x = 1"], [greedy(4)] * 3 + [greedy(2)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    assert llm.wait_for_completion(use_tqdm=False) == []
    chat = llm.enqueue_chat([{"role": "user", "content": "hi"}], greedy(2)) \
        if llm.get_tokenizer().chat_template else llm.enqueue(["hi"], greedy(2))
    assert [o.request_id for o in llm.wait_for_completion(use_tqdm=False)] == chat


def test_move_directionality_and_batch_update_are_vllms():
    entries = {0: "a", 1: "b", 2: "c"}
    update = BatchUpdate(2, removed=[1], added=[], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    assert process_dict_updates(entries, update, lambda *a: None) and entries == {0: "a", 1: "c"}
