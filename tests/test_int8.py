"""8-bit weights (``quantization="int8"``): every linear and the embedding quantized at load,
int8 per output row with a float32 scale; activations in the model's dtype.

The spec is the checkpoint with each weight replaced by its dequantized value, run by Hugging
Face: the plain path in float32 gives its greedy tokens, and so do the fast paths (the compiled
8-bit kernel, and the matmul on the weight dequantized per call). The kernel equals model.py's
dequantize-then-matmul within rounding; the quality standard (teacher-forced log-probabilities
against the float32 engine, benchmarks/int8_quality.py) holds on the demo model; the resident
weights are at most 55 % of bfloat16's; the prefix cache, chunked prefill and preemption change
no token; load_weights quantizes what it loads; other quantizations are refused by name.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.int8_quality import engine_logits, logprob_error, text_ids
from fast.kernels import compiled_kernels
from fast.linear import INT8_ROWS, Int8Product, Int8SiluMLP
from helpers import DEMO_MODEL_DIR, GreedyReference, build_checkpoint, greedy, make_llm, random_prompt
from model import MLP, Int8Linear, Linear, dequantize_rows, load_model, quantize_rows

PATHS = [dict(fast_paths=False), dict(enforce_eager=True), dict(enforce_eager=False)]
PATH_IDS = ["plain", "fast-no-kernels", "fast-kernels"]


def dequantized_checkpoint(arch: str, out_dir) -> str:
    """``arch``'s test checkpoint with every matrix (linears, embedding) replaced by its int8
    round trip: what an int8 engine must compute exactly, as Hugging Face runs it."""
    from transformers import AutoModelForCausalLM
    source = build_checkpoint(arch, str(out_dir / "source"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.copy_(dequantize_rows(*quantize_rows(param), torch.float32))
    model.save_pretrained(str(out_dir / "dequantized"))
    return source, str(out_dir / "dequantized")


def test_rows_round_trip_within_half_a_scale():
    w = torch.randn(9, 70) * torch.logspace(-3, 2, 9)[:, None]
    w[4] = 0.0  # a row of zeros quantizes to zeros
    values, scale = quantize_rows(w)
    assert values.dtype == torch.int8 and values.abs().max() <= 127 and scale.dtype == torch.float32
    assert (values.abs().amax(dim=1)[[i for i in range(9) if i != 4]] == 127).all()
    assert (dequantize_rows(values, scale, torch.float32) - w).abs().le(scale[:, None] / 2 + 1e-12).all()
    assert not values[4].any() and torch.isfinite(scale).all()


@pytest.mark.parametrize("arch", ["llama", "llama3_tied", "qwen3"])
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_tokens_are_hf_on_the_dequantized_weights(arch, path, tmp_path_factory):
    source, dequantized = _checkpoints(arch, tmp_path_factory)
    reference = GreedyReference(dequantized)
    prompts = [random_prompt(n, 500 + n) for n in (5, 17, 40)]
    llm = make_llm(source, quantization="int8", **path)
    assert llm.llm_engine.model.quantization == "int8"
    reference.compare_all(prompts, llm.generate(prompts, greedy(12), use_tqdm=False), 12)


_BUILT: dict = {}


def _checkpoints(arch, factory):
    if arch not in _BUILT:
        _BUILT[arch] = dequantized_checkpoint(arch, factory.mktemp(f"int8_{arch}"))
    return _BUILT[arch]


@pytest.fixture(scope="module")
def kernels():
    module = compiled_kernels().module
    assert module is not None, compiled_kernels().reason  # g++ is on every machine this project uses
    if not module.int8_linear_available():
        pytest.skip("this CPU has no AVX-512: the 8-bit kernel is not built here")
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, INT8_ROWS, INT8_ROWS + 1, 33])
@pytest.mark.parametrize("in_features", [64, 100])
def test_kernel_equals_the_plain_part_within_rounding(kernels, dtype, rows, in_features):
    torch.manual_seed(rows)
    linear = Int8Linear.of(Linear(in_features, 48).to(dtype))
    mlp = MLP(SimpleNamespace(hidden_act="silu", hidden_size=in_features, intermediate_size=24,
                              mlp_bias=True)).to(dtype)
    mlp.gate_up_proj, mlp.down_proj = Int8Linear.of(mlp.gate_up_proj), Int8Linear.of(mlp.down_proj)
    x = torch.randn(rows, in_features).to(dtype)
    product = Int8Product(kernels)
    with torch.inference_mode():
        want, want_mlp = linear.compute(x), mlp.compute(x)
        got, got_mlp = product(linear, x), Int8SiluMLP(product)(mlp, x)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    assert got.dtype == dtype and got_mlp.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got_mlp.float(), want_mlp.float(), **tol)


def test_quality_standard_on_the_demo_model():
    """Teacher-forced over benchmarks/int8_quality.py's text: measured there at a mean |log p
    error| of 0.052, a max of 0.35 and 97.7 % greedy agreement (bfloat16 alone: 0.036, 0.38,
    98.8 %); the bounds leave room for another CPU's rounding, not for a broken quantizer."""
    model_dir = str(DEMO_MODEL_DIR)
    ids = text_ids(model_dir)
    reference = engine_logits(model_dir, ids, torch.float32)
    got = logprob_error(engine_logits(model_dir, ids, torch.bfloat16, "int8"), reference, ids)
    assert got["mean"] <= 0.08 and got["max"] <= 0.75 and got["agreement"] >= 0.95, got


def resident_bytes(model) -> int:
    """Bytes of the model's weights, each storage once (a tied head counts once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "llama3_tied"])
def test_resident_weights_at_most_55_percent_of_bfloat16(arch, tmp_path):
    model_dir = build_checkpoint(arch, str(tmp_path), hidden_size=256, intermediate_size=512)
    cpu = torch.device("cpu")
    bf16 = resident_bytes(load_model(model_dir, torch.bfloat16, cpu))
    int8 = resident_bytes(load_model(model_dir, torch.bfloat16, cpu, quantization="int8"))
    assert int8 <= 0.55 * bf16, (int8, bf16)


def test_prefix_cache_chunked_prefill_and_preemption_change_no_token(llama_dir):
    prefix = random_prompt(40, 610)
    prompts = [prefix + random_prompt(3 + i, 620 + i) for i in range(6)]
    plain = make_llm(llama_dir, quantization="int8", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(10), use_tqdm=False)]
    tight = make_llm(llama_dir, quantization="int8", block_size=4, num_kv_blocks=22,
                     max_num_batched_tokens=24)
    tight.generate([prefix + [7]], greedy(1), use_tqdm=False)  # the prefix cached
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy(10), use_tqdm=False)]
    assert got == want
    stats = tight.llm_engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["preemptions"] > 0, stats


def test_load_weights_quantizes_what_it_loads(tmp_path):
    from safetensors.torch import load_file
    first = build_checkpoint("qwen3", str(tmp_path / "a"), seed=1)
    second = build_checkpoint("qwen3", str(tmp_path / "b"), seed=2)
    prompts = [random_prompt(9, 640), random_prompt(21, 641)]
    fresh = make_llm(second, quantization="int8")
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy(8), use_tqdm=False)]
    llm = make_llm(first, quantization="int8")
    llm.generate(prompts, greedy(8), use_tqdm=False)
    llm.llm_engine.model.load_weights(load_file(f"{second}/model.safetensors").items())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
    assert got == want


def test_other_quantizations_are_refused_by_name(llama_dir):
    from engine import LLM
    with pytest.raises(ValueError, match="Unknown quantization method: fp8"):
        LLM(llama_dir, quantization="fp8")
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        load_model(llama_dir, torch.float32, torch.device("cpu"), quantization="int4")
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(llama_dir, quantization_config={"quant_method": "awq"})
