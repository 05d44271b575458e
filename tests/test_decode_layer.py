"""A decode step's decoder layer in one compiled call (fast/decode_layer.py) is the layer's parts'
own result, bit for bit: the same greedy tokens and the same log-probabilities as the same fast
engine with the fused layer off, on every architecture and weight format whose kernels this CPU
runs; and a step the fused call cannot take (a prompt chunk, a part's forward hook, a linear
without a kernel for its row count) runs part by part.
"""
from __future__ import annotations

import pytest
import torch

import fast.backend
from fast.kernels import compiled_kernels
from helpers import ARCHS, build_checkpoint, greedy, make_llm, random_prompt

_BUILT: dict = {}


def checkpoint(arch: str, factory) -> str:
    if arch not in _BUILT:
        _BUILT[arch] = build_checkpoint(arch, str(factory.mktemp(f"decode_layer_{arch}")))
    return _BUILT[arch]


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused layer's calls (the compiled module's ``decode_layer``)."""
    module = compiled_kernels().module
    if module is None:
        pytest.skip(f"no compiled kernels here: {compiled_kernels().reason}")
    counted = {"n": 0}
    fused = module.decode_layer

    def counting(*args):
        counted["n"] += 1
        return fused(*args)

    monkeypatch.setattr(module, "decode_layer", counting)
    return counted


def formats_here() -> list:
    module = compiled_kernels().module
    out = [None]  # bfloat16 weights: the few-row linear, where the build has AVX-512 BF16
    if module is not None and module.int8_linear_available():
        out.append("int8")
    if module is not None and module.block_linear_available():
        out += ["int4", "q8_0"]
    return out


def run(model: str, quantization, prompts, fused: bool, monkeypatch, dtype="bfloat16", **kw):
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(fast.backend, "layer_replacements", lambda *a: {})
        llm = make_llm(model, dtype=dtype, quantization=quantization, **kw)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompts, greedy(8, logprobs=3), use_tqdm=False)]


@pytest.mark.parametrize("quantization", formats_here())
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layer_is_the_parts_bit_for_bit(arch, quantization, calls, monkeypatch, tmp_path_factory):
    model = checkpoint(arch, tmp_path_factory)
    if quantization is None and not compiled_kernels().module.small_linear_available():
        pytest.skip("no few-row bfloat16 linear in this build: bfloat16 decode runs oneDNN, part by part")
    # one sequence, then three decoding together (no shared leading block: the decode kernel)
    for prompts in ([random_prompt(37, 5)], [random_prompt(n, 40 + n) for n in (9, 70, 23)]):
        calls["n"] = 0
        fused = run(model, quantization, prompts, True, monkeypatch)
        assert calls["n"] > 0, "the fused layer never ran"
        calls["n"] = 0
        parts = run(model, quantization, prompts, False, monkeypatch)
        assert calls["n"] == 0
        assert fused == parts


@pytest.mark.parametrize("quantization", [q for q in formats_here() if q is not None])
def test_float32_activations_fuse_too(quantization, calls, monkeypatch, tmp_path_factory):
    """The 8-bit and block kernels take float32 rows: a float32 model's layers fuse as well."""
    model = checkpoint("qwen2", tmp_path_factory)
    prompts = [random_prompt(n, 70 + n) for n in (12, 33)]
    fused = run(model, quantization, prompts, True, monkeypatch, dtype="float32")
    assert calls["n"] > 0
    assert fused == run(model, quantization, prompts, False, monkeypatch, dtype="float32")


def test_prompt_steps_and_hooked_layers_run_part_by_part(calls, monkeypatch, tmp_path_factory):
    model = checkpoint("qwen3", tmp_path_factory)
    llm = make_llm(model, dtype="bfloat16", quantization="q8_0" if "q8_0" in formats_here() else None)
    layers = llm.llm_engine.engine_core.model.layers
    llm.generate([random_prompt(30, 1)], greedy(1), use_tqdm=False)  # one step: the prompt's
    assert calls["n"] == 0
    seen = []
    hook = layers[1].self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    try:
        llm.generate([random_prompt(30, 2)], greedy(4), use_tqdm=False)
    finally:
        hook.remove()
    assert seen == [30, 1, 1, 1]  # the hooked part ran at every step, its layer part by part
    # every other layer fused at the three decode steps; the hooked one never
    assert calls["n"] == 3 * (len(layers) - 1)


def test_a_row_count_past_the_few_row_kernels_runs_part_by_part(calls, monkeypatch, tmp_path_factory):
    """bfloat16 weights past the few-row linear's rows run oneDNN, which the C++ layer does not
    name; the 8- and 4-bit formats name a kernel for every row count (lane_linear past a few)."""
    model = checkpoint("llama", tmp_path_factory)
    prompts = [random_prompt(8 + n, 300 + n) for n in range(20)]  # 20 rows: past small_linear's 4
    fused = run(model, None, prompts, True, monkeypatch)
    assert calls["n"] == 0
    assert fused == run(model, None, prompts, False, monkeypatch)
    if "int4" in formats_here():
        calls["n"] = 0
        fused = run(model, "int4", prompts, True, monkeypatch)
        assert calls["n"] > 0
        assert fused == run(model, "int4", prompts, False, monkeypatch)


def test_the_fused_call_checks_what_it_reads(calls):
    module = compiled_kernels().module
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    pool = torch.zeros(1, 16, 4, dtype=torch.bfloat16)
    ones, none = torch.ones(8, dtype=torch.bfloat16), None
    index = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="four linears"):
        module.LayerWeights([ones, ones], 1e-6, [0, 0], [x, x], [none, none], [none, none], none, none, 1e-6, 0.5)
    layer = module.LayerWeights([ones, ones], 1e-6, [0] * 4, [x] * 4, [none] * 4, [none] * 4, none, none, 1e-6, 0.5)
    with pytest.raises(RuntimeError, match="contiguous pools"):
        module.decode_layer(x, layer, x[:, None], x[:, None], pool, pool.float(), index, index, index[None], index,
                            index + 1, 16)


def test_a_layer_is_read_again_when_a_part_changes(calls, monkeypatch, tmp_path_factory):
    """What the fused call reads of a layer is kept between steps, and read again when any of
    it changes: here every norm's eps, set between two requests (no parameter moves, so the
    engine derives nothing again); the tokens stay the parts' own under the new eps."""
    model = checkpoint("qwen3", tmp_path_factory)
    quantization = "int4" if "int4" in formats_here() else None
    if quantization is None and not compiled_kernels().module.small_linear_available():
        pytest.skip("no few-row bfloat16 linear in this build")

    def generate(fused: bool) -> list:
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(fast.backend, "layer_replacements", lambda *a: {})
            llm = make_llm(model, dtype="bfloat16", quantization=quantization)
        out = []
        for seed in (7, 8):
            outputs = llm.generate([random_prompt(21, seed)], greedy(8, logprobs=3), use_tqdm=False)
            out.append((outputs[0].outputs[0].token_ids, outputs[0].outputs[0].logprobs))
            for layer in llm.llm_engine.engine_core.model.layers:
                layer.input_layernorm.eps = layer.post_attention_layernorm.eps = 0.5
        return out

    calls["n"] = 0
    fused = generate(True)
    assert calls["n"] > 0
    assert fused == generate(False)
    llm = make_llm(model, dtype="bfloat16", quantization=quantization)
    before = llm.generate([random_prompt(21, 8)], greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert (before.token_ids, before.logprobs) != fused[1]  # the new eps changed the result
