"""A step that fails never leaves the bookkeeping saying what the KV pool does not hold.

The case that once gave wrong tokens: request A's blocks are cached, request B's step reuses
them (evicts) and its forward writes B's K/V into them, then the step fails after some layer.
Putting A's hashes back over B's K/V would serve B's K/V as A's prefix; here the eviction holds
whatever becomes of the step, so A runs again with Hugging Face's tokens -- on every path, for
a failure after each layer, a RuntimeError or a Ctrl-C, and a Ctrl-C at every line of that
step. And a weight update that lands while a forward runs: that step's K/V is never cached,
the next step prefills again with the new weights.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_no_leak, greedy, make_llm, random_prompt
from invariants import check_accounting
from line_faults import LineFault, first_occurrences

PATHS = {"plain": dict(fast_paths=False), "eager": dict(enforce_eager=True), "kernels": {},
         "int8": dict(quantization="int8")}
A, B = random_prompt(16, seed=101), random_prompt(24, seed=102)
SMALL_POOL = dict(block_size=4, num_kv_blocks=8)  # B's blocks can only come from A's


class FailAfter:
    """A forward hook on one decoder layer that raises ``exc`` once, while B is computed."""

    def __init__(self, llm, layer: int, exc: type[BaseException]) -> None:
        self.exc, self.armed = exc, True
        self.handle = llm.model.layers[layer].register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            raise self.exc(f"after layer {module}")


def tokens(llm, prompt, n: int = 4) -> list[int]:
    return list(llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("path", PATHS)
def test_a_failed_step_that_evicted_never_serves_the_kv_it_overwrote(llama_dir, reference, path, layer, exc):
    llm = make_llm(llama_dir, **SMALL_POOL, **PATHS[path])
    want = tokens(make_llm(llama_dir, **SMALL_POOL, **PATHS[path]), A)
    if path != "int8":  # int8's spec is HF on the dequantized weights: a fresh engine stands in
        reference.compare(A, want, 4, path)
    assert tokens(llm, A) == want
    cached = llm.stats()["blocks_cached"]
    fault = FailAfter(llm, layer, exc)
    with pytest.raises(exc):
        tokens(llm, B)
    fault.handle.remove()
    assert llm.stats()["evictions"] > 0 and llm.stats()["blocks_cached"] < cached
    check_accounting(llm)
    assert_no_leak(llm)
    assert tokens(llm, A) == want  # once wrong: A's hashes put back over B's K/V
    assert tokens(llm, B) == tokens(make_llm(llama_dir, **SMALL_POOL, **PATHS[path]), B)


def test_a_ctrl_c_at_every_line_of_a_step_that_evicts(llama_dir, reference):
    """B's first step (its admission evicts A's blocks) with a Ctrl-C at each line it runs;
    after each, A again gives Hugging Face's tokens and the accounting holds."""
    llm = make_llm(llama_dir, **SMALL_POOL, fast_paths=False)
    want = tokens(llm, A)
    reference.compare(A, want, 4)
    llm.add_request(B, greedy(4), request_id="b")
    with LineFault() as trace:
        llm.step()
    assert llm.stats()["evictions"] > 0
    llm.abort("b")
    points = first_occurrences(trace.lines)
    swept = 0
    for k in range(1, len(trace.lines) + 1):
        assert tokens(llm, A) == want, f"after a Ctrl-C at line {k}"
        llm.add_request(B, greedy(4), request_id="b")
        with LineFault(k) as fault:
            try:
                llm.step()
            except KeyboardInterrupt:
                swept += 1
        check_accounting(llm)
        llm.abort("b")
        if not fault.fired:  # past the step's last line (this time it ran a few lines fewer)
            break
    assert tokens(llm, A) == want
    assert swept > 300 and len(points) > 100
    assert_no_leak(llm)


class ScaleWeightsOnce:
    """A forward hook that scales every weight in place, once, while a forward runs (as an
    update from another thread would land)."""

    def __init__(self, llm) -> None:
        self.model, self.done = llm.model, False
        self.handle = llm.model.layers[0].register_forward_hook(self)

    def __call__(self, module, args, output):
        if not self.done:
            self.done = True
            scale(self.model)


def scale(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.mul_(1.25)


@pytest.mark.parametrize("path", ["plain", "eager", "kernels"])
def test_a_weight_update_landing_mid_forward_is_never_cached(llama_dir, path):
    """The step whose forward saw two sets of weights commits nothing; the next step drops the
    old K/V and prefills with the new weights: a fresh engine on the new weights' tokens, and
    no hit on anything computed before."""
    settings = dict(block_size=4, **PATHS[path])
    fresh = make_llm(llama_dir, **settings)
    scale(fresh.model)
    want = tokens(fresh, B, 6)
    llm = make_llm(llama_dir, **settings)
    tokens(llm, B, 6)  # B's blocks cached under the old weights
    hook = ScaleWeightsOnce(llm)
    hits = llm.stats()["prefix_cache_hits"]
    got = tokens(llm, B, 6)
    hook.handle.remove()
    assert hook.done and got == want
    assert llm.stats()["prefix_cache_hits"] == hits, "a hit on K/V of the old weights"


def test_a_reset_asked_for_while_a_forward_runs_changes_nothing(llama_dir, reference):
    """A hook calling reset_prefix_cache() mid-forward: the step's plan holds cached blocks, so
    nothing is reset (False, as vLLM answers when it cannot); the step commits as planned."""
    llm = make_llm(llama_dir, block_size=4, fast_paths=False)
    tokens(llm, A)
    answers = []
    handle = llm.model.layers[0].register_forward_hook(
        lambda *_: answers.append(llm.reset_prefix_cache()) if not answers else None)
    got = tokens(llm, A + [5, 6, 7])
    handle.remove()
    assert answers == [False] and llm.stats()["prefix_cache_hits"] == 16
    reference.compare(A + [5, 6, 7], got, 4)
    assert llm.reset_prefix_cache()


@pytest.mark.parametrize("strategy", ["incremental", "recompute"])
def test_a_commit_calls_no_hash_function(llama_dir, strategy):
    """Every hash a commit's saves use was computed before it (prepare_saves): the hash
    function is never called inside Scheduler.commit's changes, a decode block's save included."""
    llm = make_llm(llama_dir, block_size=4, hash_strategy=strategy, max_num_batched_tokens=8)
    real, inside, calls = llm.prefix_cache.hash_fn, [], []
    llm.prefix_cache.hash_fn = lambda data, seed: (calls.append(bool(inside)), real(data, seed))[1]
    cache_blocks = llm.prefix_cache.cache_blocks

    def saving(*args):
        inside.append(1)
        try:
            return cache_blocks(*args)
        finally:
            inside.pop()

    llm.prefix_cache.cache_blocks = saving
    tokens(llm, random_prompt(19, 5), 9)
    assert calls and not any(calls)
