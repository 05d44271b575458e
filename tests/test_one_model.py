"""One model: what runs is the model the user holds, on every path (plain, fast without kernels,
fast with kernels) and dtype. Weights changed in place, by ``load_state_dict``, by vLLM's
``model.load_weights`` through ``apply_model``, or by a worker extension through
``collective_rpc`` are seen whole by the next step -- it gives what a fresh engine on the new
weights gives (and HF's tokens in float32) -- and the prefix cache never serves K/V computed
under the old weights; forward hooks on the user's modules fire on every path."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open

from helpers import GreedyReference, build_checkpoint, greedy, make_llm, random_prompt

PATHS = {"plain": dict(fast_paths=False), "eager": dict(enforce_eager=True), "kernels": dict()}
DTYPES = ["float32", "bfloat16"]
PROMPT = random_prompt(30, seed=7)
MAX_TOKENS = 10


class WeightSwap:
    """A worker extension as RL frameworks write one: new weights pushed into the worker's model."""

    def swap_weights(self, checkpoint_dir: str) -> list[str]:
        return sorted(self.model_runner.model.load_weights(checkpoint_tensors(checkpoint_dir)))


def checkpoint_tensors(checkpoint_dir: str):
    """(HF name, tensor) of every tensor of a checkpoint, as a trainer would stream them."""
    with safe_open(f"{checkpoint_dir}/model.safetensors", framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> tuple[str, str]:
    """Two Qwen3 checkpoints (head norms, so every replaceable part is exercised), one config."""
    return tuple(build_checkpoint("qwen3", str(tmp_path_factory.mktemp(f"one_model_{s}")), seed=s)
                 for s in (31, 32))


def tokens(llm, prompt=PROMPT) -> list[int]:
    return list(llm.generate([prompt], greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids)


def hits(llm) -> int:
    return llm.stats()["prefix_cache_hits"]


def flip_down_proj(model) -> None:
    """An in-place edit, as steering code makes one."""
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-1)


def check_fresh_step(llm, want: list[int]) -> None:
    """The next generate gives ``want``, computing the prompt afresh (no hit on old K/V); a
    repeat then hits the cache and gives the same."""
    before = hits(llm)
    assert tokens(llm) == want
    assert hits(llm) == before, "a prefix-cache hit on K/V of the old weights"
    assert tokens(llm) == want and hits(llm) > before


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_every_weight_change_is_seen_whole_by_the_next_step(two_checkpoints, path, dtype):
    a, b = two_checkpoints
    settings = dict(PATHS[path], dtype=dtype, block_size=8)
    llm = make_llm(a, worker_extension_cls="test_one_model.WeightSwap", **settings)
    on_a = tokens(llm)  # the prompt's blocks are now cached, under A's weights
    fresh_b = make_llm(b, **settings)
    on_b = tokens(fresh_b)
    edited_b = make_llm(b, **settings)
    flip_down_proj(edited_b.model)
    on_b_edited = tokens(edited_b)
    assert len({tuple(on_a), tuple(on_b), tuple(on_b_edited)}) == 3  # the changes show
    if dtype == "float32":
        GreedyReference(b).compare(PROMPT, on_b, MAX_TOKENS, f"{path}: a fresh engine on B")
    llm.model.load_state_dict(fresh_b.model.state_dict())  # in place
    check_fresh_step(llm, on_b)
    names = llm.collective_rpc("swap_weights", args=(a,))[0]
    assert "layers.0.self_attn.qkv_proj.weight" in names
    check_fresh_step(llm, on_a)
    llm.apply_model(lambda model: model.load_weights(checkpoint_tensors(b)))
    assert llm.reset_prefix_cache()  # what a user calls; the engine would have dropped them anyway
    check_fresh_step(llm, on_b)
    flip_down_proj(llm.model)
    check_fresh_step(llm, on_b_edited)


@pytest.mark.parametrize("path", PATHS)
def test_forward_hooks_fire_on_every_path(two_checkpoints, path):
    """Hooks on parts a backend replaces, or computes together with others, fire; a hook that
    changes an output changes the tokens exactly as on the plain path."""
    a, _ = two_checkpoints
    llm = make_llm(a, **PATHS[path])
    model, calls = llm.model, []
    for name in ("layers.0.mlp.gate_up_proj", "layers.0.self_attn.k_norm", "layers.1.input_layernorm",
                 "layers.1.self_attn.rotation", "lm_head"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    model.layers[0].mlp.register_forward_hook(lambda m, i, o: o * 0.5)
    got = tokens(llm)
    assert set(calls) == {"layers.0.mlp.gate_up_proj", "layers.0.self_attn.k_norm",
                          "layers.1.input_layernorm", "layers.1.self_attn.rotation", "lm_head"}
    plain = make_llm(a, fast_paths=False)
    plain.model.layers[0].mlp.register_forward_hook(lambda m, i, o: o * 0.5)
    assert got == tokens(plain) != tokens(make_llm(a, fast_paths=False))


def test_load_weights_refuses_a_bad_batch_whole(two_checkpoints):
    """A name no parameter takes, a wrong shape or NaN: refused naming the tensor, and the
    tensors before it in the batch are not applied either."""
    a, b = two_checkpoints
    llm = make_llm(a)
    before = tokens(llm)
    good = list(checkpoint_tensors(b))
    bad_batches = {"no parameter of this Qwen3ForCausalLM takes weight 'model.layers.9.mlp.up_proj.weight'":
                   good + [("model.layers.9.mlp.up_proj.weight", good[0][1])],
                   "has shape": good + [("model.norm.weight", torch.ones(3))],
                   "NaN or infinite": good + [("model.norm.weight", torch.full_like(llm.model.norm.weight, torch.nan))]}
    for message, batch in bad_batches.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.model.load_weights(batch)
    assert tokens(llm) == before


def test_a_grpo_style_loop_on_the_demo_model():
    """generate, change the weights, reset the prefix cache, generate: each generation equals a
    fresh engine's on the weights of that round (the demo model, the default path)."""
    from helpers import DEMO_MODEL_DIR
    llm = make_llm(DEMO_MODEL_DIR, block_size=8)
    prompts = [random_prompt(20, seed=s, vocab=2048) for s in (1, 2)]
    state = {k: v.clone() for k, v in llm.model.state_dict().items()}
    for round_ in range(2):
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
        fresh = make_llm(DEMO_MODEL_DIR, block_size=8)
        fresh.model.load_state_dict(state)
        assert outs == [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy(8), use_tqdm=False)]
        step = {k: v * (1 + 0.05 * torch.randn_like(v)) for k, v in state.items()}  # "the optimizer step"
        step["lm_head.weight"] = step["embed_tokens.weight"]  # tied: one tensor
        llm.apply_model(lambda model: model.load_weights((f"model.{k}", v) for k, v in step.items()))
        llm.reset_prefix_cache()
        state = step


@pytest.mark.parametrize("path", PATHS)
def test_a_write_through_data_is_seen_after_reset_prefix_cache(two_checkpoints, path):
    """``param.data.copy_(new)`` moves no version counter, so no check can see it; RL
    frameworks call ``reset_prefix_cache()`` after a weight sync, and that call makes the
    engine drop cached K/V and derive every packed copy again (docs/vllm_api.md)."""
    a, b = two_checkpoints
    fresh = make_llm(b, **PATHS[path])
    want = tokens(fresh)
    llm = make_llm(a, **PATHS[path])
    assert tokens(llm) != want
    new = fresh.llm_engine.model.state_dict()
    with torch.no_grad():
        for name, param in llm.llm_engine.model.named_parameters():
            param.data.copy_(new[name])
    llm.reset_prefix_cache()
    assert tokens(llm) == want
    assert tokens(llm) == want
