"""The plain path is the spec: ``LLM(ckpt, fast_paths=False)`` (core/backend.py's ``Backend``:
model.py's paged attention and plain linear layers only) and ``fast_paths=True`` (fast/: attention
kinds, oneDNN-packed linears) give the same greedy tokens, and both give Hugging Face's, on every architecture,
over a workload that hits the prefix cache, chunks prefill and mixes decode with prefill."""
from __future__ import annotations

import pytest
import torch

from core.backend import Backend
from fast import linear as fast_linear
from fast.backend import FastBackend
from fast.linear import PackedLinear, PackedSiluMLP, packed_replacements
from helpers import GreedyReference, assert_no_leak, greedy, make_llm, random_prompt
from invariants import engine_core
from model import CausalLM, load_model

MAX_TOKENS = 12
CPU = torch.device("cpu")


def workload(seed: int) -> list[list[int]]:
    """Prompts sharing a 40-token prefix (cache hits in the second round), and others of mixed
    lengths, up to past mistral's 48-token sliding window."""
    prefix = random_prompt(40, seed)
    shared = [prefix + random_prompt(n, seed + 1 + n) for n in (3, 17, 30)]
    return shared + [random_prompt(n, seed + 50 + n) for n in (1, 9, 64, 110)]


def record_steps(llm) -> list[list[tuple[int, int]]]:
    """(start, length) of every sequence's chunk in every forward, by wrapping the plan."""
    backend = engine_core(llm).model_runner.backend
    steps, plan = [], backend.plan
    backend.plan = lambda chunks, block_size: (
        steps.append([(c.start, c.length) for c in chunks]) or plan(chunks, block_size))
    return steps


def run_twice(model_dir, fast_paths: bool, prompts):
    """Two rounds on one engine (the second hits the prefix cache); outputs and step shapes."""
    llm = make_llm(model_dir, fast_paths=fast_paths, block_size=8, max_num_batched_tokens=48,
                   max_num_seqs=5)
    steps = record_steps(llm)
    outs = [llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False) for _ in range(2)]
    assert llm.stats()["prefix_cache_hits"] > 0
    assert_no_leak(llm)
    return [[o.token_ids for o in round_] for round_ in outs], steps


def assert_workload_covered(steps) -> None:
    """The shapes this test is about did occur: chunked prefill and decode mixed with prefill."""
    continued = any(start > 0 and length > 1 for step in steps for start, length in step)
    mixed = any({length == 1 for _, length in step} == {True, False} for step in steps)
    assert continued and mixed, "the workload no longer chunks prefill or mixes decode with prefill"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_plain_and_fast_paths_give_the_same_tokens_as_hf(checkpoints, arch):
    prompts = workload(seed=300 + len(arch))
    plain, plain_steps = run_twice(checkpoints[arch], False, prompts)
    fast, fast_steps = run_twice(checkpoints[arch], True, prompts)
    assert plain == fast
    assert plain_steps == fast_steps
    assert_workload_covered(plain_steps)
    reference = GreedyReference(checkpoints[arch])
    for round_ in plain:
        reference.compare_all(prompts, round_, MAX_TOKENS)


def test_plain_engine_uses_no_fast_machinery(llama_dir):
    """fast_paths=False runs the core's own Backend and replaces nothing; the fast engine runs
    the user's very model (no copy), its linear parts and SiLU MLPs replaced through the seam."""
    plain, fast = (make_llm(llama_dir, fast_paths=f) for f in (False, True))
    assert type(engine_core(plain).model_runner.backend) is Backend
    backend = engine_core(fast).model_runner.backend
    assert isinstance(backend, FastBackend) and backend.model is fast.model
    for llm in (plain, fast):
        llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
        model = llm.model
        assert type(model) is CausalLM
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) == 1 + 4 * len(model.layers)  # lm_head; qkv, o, gate_up, down per layer
    assert all(part.replacement is None for _, part in plain.model.replaceable_parts())
    assert isinstance(fast.model.lm_head.replacement, PackedLinear)
    assert all(isinstance(layer.mlp.replacement, PackedSiluMLP) for layer in fast.model.layers)


def test_packed_linears_compute_the_plain_linears(llama_dir):
    """Where oneDNN runs here, every linear part and SiLU MLP gets a packed replacement that
    gives model.py's result from the part's own parameters; removing them restores the plain math."""
    model = load_model(llama_dir, "float32", CPU)
    assert fast_linear.onednn_linears_usable(CPU, torch.float32)  # torch's x86 CPU build has oneDNN
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = [(layer.mlp(x), layer.self_attn.qkv_proj(x)) for layer in model.layers] + [model.lm_head(x)]
        replacements = packed_replacements(model)
        assert len(replacements) == 5 * len(model.layers) + 1  # qkv, o, gate_up, down, the MLP; lm_head
        model.install(replacements)
        got = [(layer.mlp(x), layer.self_attn.qkv_proj(x)) for layer in model.layers] + [model.lm_head(x)]
        model.install({})
        assert model.lm_head.replacement is None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
