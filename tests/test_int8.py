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
import torch.nn.functional as F

from benchmarks.int8_quality import engine_logits, logprob_error, text_ids
from core.formats import FORMATS
from core.int8_format import dequantize_rows, quantize_rows
from fast.format_kernels import FormatLinearKernel, FusedSiluMLP
from fast.int8_linear import INT8_FEW_ROWS, INT8_ROWS, INT8_TILE_ROWS, Int8Kernels
from fast.kernels import compiled_kernels
from helpers import DEMO_MODEL_DIR, GreedyReference, build_checkpoint, greedy, make_llm, random_prompt
from model import MLP, FormatLinear, Linear, load_model

PATHS = [dict(fast_paths=False), dict(enforce_eager=True), dict(enforce_eager=False)]
PATH_IDS = ["plain", "fast-no-kernels", "fast-kernels"]


def int8(linear: Linear) -> FormatLinear:
    """``linear`` with 8-bit weights, as ``quantization="int8"`` makes every linear."""
    return FormatLinear.of(linear, FORMATS["int8"])


def int8_kernel(kernels, part: FormatLinear, dtype, tiles: bool = False) -> FormatLinearKernel:
    """The fast layer's replacement of an 8-bit linear without the lane kernel (exact
    activations): its kernel per row count, chosen once."""
    return FormatLinearKernel(Int8Kernels(kernels, tiles), part, dtype)


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
    linear = int8(Linear(in_features, 48).to(dtype))
    mlp = MLP(SimpleNamespace(hidden_act="silu", hidden_size=in_features, intermediate_size=24,
                              mlp_bias=True)).to(dtype)
    mlp.gate_up_proj, mlp.down_proj = int8(mlp.gate_up_proj), int8(mlp.down_proj)
    x = torch.randn(rows, in_features).to(dtype)
    with torch.inference_mode():
        want, want_mlp = linear.compute(x), mlp.compute(x)
        got = int8_kernel(kernels, linear, dtype)(linear, x)
        got_mlp = FusedSiluMLP(int8_kernel(kernels, mlp.gate_up_proj, dtype))(mlp, x)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    assert got.dtype == dtype and got_mlp.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got_mlp.float(), want_mlp.float(), **tol)


def quantized_activations_product(x, values, scale, bias, silu_mul):
    """lane_linear's math: x per block of 32 to int8 (max|x| / 127, round to nearest even, in
    float32 as the kernel rounds), then in float64 the integer dots with the int8 values, times
    the block's and the row's scales."""
    k = x.shape[1]
    blocks = F.pad(x.float(), (0, -k % 32)).unflatten(1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
    y = (q.double() * amax.double() / 127).flatten(1)[:, :k] @ values.double().t() * scale.double()
    y = y + bias.double() if bias is not None else y
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [0, 1, 2, 16, 17, 40])
@pytest.mark.parametrize("in_features", [32, 70, 100, 1056])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_lane_kernel_is_the_quantized_activations_math(kernels, dtype, rows, in_features, silu_mul):
    """50 weight rows: lane_linear's copies of 16 end in a partial one; K off 32 and 64 too."""
    if not kernels.lane_linear_available():
        pytest.skip("built without AVX-512 VNNI: no lane kernel here")
    torch.manual_seed(rows + in_features)
    values, scale = torch.randint(-127, 128, (50, in_features), dtype=torch.int8), torch.rand(50) * 0.01
    x, bias = torch.randn(rows, in_features).to(dtype), torch.randn(50)
    got = kernels.lane_linear(x, values, scale, bias, 1, silu_mul)
    want = quantized_activations_product(x, values, scale, bias, silu_mul)
    assert got.dtype == dtype and got.shape == want.shape
    if rows:
        step = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
        assert ((got.double() - want).abs() <= want.abs() * step + 1e-5 * (1 + want.abs().max())).all()


@pytest.fixture(scope="module")
def tiles(kernels):
    if not kernels.int8_tiles_available():
        pytest.skip("no AMX-INT8 / AVX-512 BF16 here (or Linux refused the tile registers): no tile kernel")
    return kernels


def exact_product(x, values, scale, bias, silu_mul):
    """x values^T times the rows' scales (+ bias, silu(gate) * up) in float64: the product the
    tile kernel must round once."""
    y = (x.double() @ values.double().t()) * scale.double()
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(4, 64, 32), (16, 100, 48), (17, 1000, 34), (40, 130, 80), (128, 64, 16)])
def test_tile_kernel_is_the_exact_product_rounded_once(tiles, shape, with_bias, silu_mul):
    """Inputs spread over 2^-12..2^12 of each other: every value lies on the row's grid, so the
    result is the float64 product rounded once to bfloat16 (a float32 recombination may move
    a tie by one bfloat16 step)."""
    rows, k, n = shape
    torch.manual_seed(rows + k + n)
    x = (torch.randn(rows, k) * 2.0 ** torch.randint(-12, 13, (rows, k))).bfloat16()
    values = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = tiles.int8_tiles(x, values, scale, bias, silu_mul)
    want = exact_product(x, values, scale, bias, silu_mul)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().bfloat16().float().abs() * 2.0 ** -7  # one bfloat16 step at the value
    error = (got.double() - want).abs()
    assert bool((error <= step.double() + 1e-30).all()), float((error / step.clamp_min(1e-30)).max())


def test_tile_kernel_rows_of_any_range_and_non_finite_rows(tiles):
    """A row whose values span 2^60: those below 2^-20 of its largest are off the grid by at most
    2^-28 of it; a row holding inf or NaN computes as the float32 matmul (as model.py does)."""
    torch.manual_seed(3)
    k, n = 192, 32
    values = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01
    wide = (torch.randn(5, k) * 2.0 ** torch.randint(-30, 31, (5, k))).bfloat16()
    got = tiles.int8_tiles(wide, values, scale, None, False).double()
    want = exact_product(wide, values, scale, None, False)
    bound = wide.double().abs().amax(1, keepdim=True) * 2.0 ** -28 * values.double().abs().sum(1) * scale.double()
    step = want.abs() * 2.0 ** -7
    assert bool(((got - want).abs() <= bound + step).all())
    odd = torch.randn(6, k).bfloat16()
    odd[1, 5], odd[3, 7], odd[4, 0] = float("inf"), float("nan"), float("-inf")
    linear = int8(Linear(k, n).to(torch.bfloat16))
    with torch.inference_mode():
        got = tiles.int8_tiles(odd, linear.weight, linear.weight_scale, linear.bias, False)
        want = linear.compute(odd)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, equal_nan=True)


class CountingKernels:
    """The kernel module, each call counted by name (which kernel computed which call)."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def __getattr__(self, name):
        kernel = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return kernel(*args, **kwargs)
        return counted


@pytest.mark.parametrize("rows", [1, INT8_FEW_ROWS, INT8_FEW_ROWS + 1, INT8_ROWS, INT8_ROWS + 1,
                                  INT8_TILE_ROWS, INT8_TILE_ROWS + 1])
def test_each_row_count_goes_to_its_kernel(tiles, rows):
    linear = int8(Linear(64, 32).to(torch.bfloat16))
    counting = CountingKernels(tiles)
    x = torch.randn(rows, 64).bfloat16()
    with torch.inference_mode():
        got = int8_kernel(counting, linear, torch.bfloat16, tiles=True)(linear, x)
        want = linear.compute(x)
    kernel = ("int8_linear" if rows <= INT8_FEW_ROWS else "int8_tiles" if rows <= INT8_TILE_ROWS
              else "int8_dequantize")
    assert counting.calls == [kernel]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    float_rows = torch.randn(min(rows, INT8_ROWS), 64)  # float32 input: never the tiles
    counting.calls.clear()
    float_linear = int8(Linear(64, 32))
    with torch.inference_mode():
        int8_kernel(counting, float_linear, torch.float32, tiles=True)(float_linear, float_rows)
    assert counting.calls == ["int8_linear"]


def test_a_batch_decoded_on_the_tiles_is_the_same_model(tiles, monkeypatch):
    """The demo model in bfloat16 on 8-bit weights: six sequences decoded together (the tile
    kernel) and again with the tiles off (the dequantized weight's matmul) give each chosen token
    the same log-probability within bfloat16's noise, and part ways only at a near-tie (each
    run's choice is the other's runner-up, within that noise)."""
    import fast.int8_linear
    prompts = [random_prompt(5 + 3 * i, 660 + i, vocab=200) for i in range(6)]
    llm = make_llm(str(DEMO_MODEL_DIR), dtype="bfloat16", quantization="int8")
    assert "8-bit tile linears" in llm.llm_engine.engine_core.model_runner.backend.describe()
    on = llm.generate(prompts, greedy(12, logprobs=2), use_tqdm=False)
    monkeypatch.setattr(fast.int8_linear, "INT8_TILE_ROWS", 0)
    llm.llm_engine.engine_core.model_runner.backend.rederive()  # each linear chooses again
    off = llm.generate(prompts, greedy(12, logprobs=2), use_tqdm=False)
    agreed = 0
    for a, b in zip(on, off):
        for step, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            la, lb = a.outputs[0].logprobs[step], b.outputs[0].logprobs[step]
            if x != y:
                assert y in la and la[x].logprob - la[y].logprob < 0.1, (step, la, lb)
                assert x in lb and lb[y].logprob - lb[x].logprob < 0.1, (step, la, lb)
                break
            assert abs(la[x].logprob - lb[x].logprob) < 0.1, (step, la, lb)
            agreed += 1
    assert agreed >= 0.9 * 6 * 12, agreed


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
    with pytest.raises(ValueError, match="quantization 'int3' is not supported; supported: int8, int4, q8_0"):
        load_model(llama_dir, torch.float32, torch.device("cpu"), quantization="int3")
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(llama_dir, quantization_config={"quant_method": "awq"})
