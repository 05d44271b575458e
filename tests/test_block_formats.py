"""The block formats of llama.cpp's kind: 4-bit (``quantization="int4"``, Q4_0's layout) and
``"q8_0"`` (Q8_0's), blocks of 32 inputs with one float16 scale each.

The spec is the checkpoint with each weight replaced by its dequantized value, run by Hugging
Face in float32: the plain path and the fast path without kernels give exactly its tokens. The
compiled kernel (fast/csrc/block_linear.cpp) quantizes the activations per block of 32 to 8 bits
as llama.cpp does, so it is held to the same math done in float64 (``reference``), and its
engine's greedy tokens to the plain path's on these checkpoints.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.formats import FORMATS
from core.int4_format import dequantize_q4_0, quantize_q4_0, unpack_q4_0
from core.q8_0_format import dequantize_q8_0, quantize_q8_0
from fast.kernels import compiled_kernels
from helpers import GreedyReference, build_checkpoint, greedy, make_llm, random_prompt

ROUND_TRIP = {"int4": lambda w: dequantize_q4_0(*quantize_q4_0(w), torch.float32),
              "q8_0": lambda w: dequantize_q8_0(*quantize_q8_0(w), torch.float32)}
EMBEDDING = {"int4": "q8_0", "q8_0": "q8_0"}  # int4 keeps the embedding (and a tied head) in Q8_0
PATHS = {"plain": dict(fast_paths=False), "fast-no-kernels": dict(enforce_eager=True)}
_BUILT: dict = {}


def dequantized_checkpoint(fmt: str, arch: str, factory) -> tuple[str, str]:
    """(source, the same checkpoint with every matrix replaced by its ``fmt`` round trip)."""
    if (fmt, arch) in _BUILT:
        return _BUILT[fmt, arch]
    from transformers import AutoModelForCausalLM
    out = factory.mktemp(f"{fmt}_{arch}")
    source = build_checkpoint(arch, str(out / "source"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                kind = EMBEDDING[fmt] if "embed_tokens" in name else fmt
                param.copy_(ROUND_TRIP[kind](param))
    model.save_pretrained(str(out / "dequantized"))
    _BUILT[fmt, arch] = source, str(out / "dequantized")
    return _BUILT[fmt, arch]


def test_round_trips_stay_within_a_step():
    torch.manual_seed(3)
    w = torch.randn(5, 96) * torch.logspace(-3, 2, 5)[:, None]
    w[2] = 0.0
    packed, scale = quantize_q4_0(w)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8 and scale.shape == (5, 3)
    step = scale.float().abs().repeat_interleave(32, dim=1)
    # Q4_0 spans -8..7 steps: one of the other sign than the largest can be a step off (and the
    # float16 scale's rounding over 8 steps)
    assert (dequantize_q4_0(packed, scale, torch.float32) - w).abs().le(step * 1.005 + 1e-6).all()
    assert unpack_q4_0(packed).max() <= 15 and not dequantize_q4_0(packed, scale, torch.float32)[2].any()
    values, scale8 = quantize_q8_0(w)
    step8 = scale8.float().repeat_interleave(32, dim=1)
    # half a step, plus the float16 rounding of the scale over up to 127 steps (127 * 2**-11)
    assert (dequantize_q8_0(values, scale8, torch.float32) - w).abs().le(step8 * 0.563 + 1e-6).all()


def test_a_shape_off_the_block_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        FORMATS["int4"].create_weights(4, 40, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("fmt", ["int4", "q8_0"])
@pytest.mark.parametrize("arch", ["llama", "llama3_tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("path", list(PATHS))
def test_tokens_are_hf_on_the_dequantized_weights(fmt, arch, path, tmp_path_factory):
    source, dequantized = dequantized_checkpoint(fmt, arch, tmp_path_factory)
    reference = GreedyReference(dequantized)
    prompts = [random_prompt(n, 700 + n) for n in (5, 17, 40)]
    llm = make_llm(source, quantization=fmt, **PATHS[path])
    assert llm.llm_engine.model.quantization == fmt
    reference.compare_all(prompts, llm.generate(prompts, greedy(10), use_tqdm=False), 10)


# ----------------------------------------------------------------------------- the kernel

@pytest.fixture(scope="module")
def kernels():
    module = compiled_kernels().module
    assert module is not None, compiled_kernels().reason
    if not module.block_linear_available():
        pytest.skip("this CPU has no AVX-512 VNNI: the block kernels are not built here")
    return module


def reference(x, weight, scale, bits, bias=None, silu_mul=False):
    """The kernel's math in float64: activations per block of 32 to int8 (max|x| / 127, round
    to nearest even), integer dots with the stored values, times both scales, summed."""
    blocks = x.float().unflatten(1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q, d = torch.round(blocks * inverse), amax / 127
    w = (unpack_q4_0(weight).double() - 8) if bits == 4 else weight.double()
    dots = torch.einsum("mbj,nbj->mnb", q.double(), w.unflatten(1, (-1, 32)))
    y = (dots * d[..., 0].double()[:, None, :] * scale.double()[None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        gate, up = y.chunk(2, -1)
        y = F.silu(gate) * up
    return y


@pytest.mark.parametrize("kernel", ["block_linear", "lane_linear"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [32, 96, 1024, 1056])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 8, 9, 17, 20])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_kernel_is_the_quantized_activations_math(kernels, kernel, bits, k, rows, silu_mul):
    """70 weight rows: lane_linear's copies of 16 end in a partial one (35 of a gate/up pair)."""
    torch.manual_seed(k + rows)
    weight, scale = (quantize_q4_0 if bits == 4 else quantize_q8_0)(torch.randn(70, k))
    x, bias = torch.randn(rows, k), torch.randn(70)
    got = getattr(kernels, kernel)(x, weight, scale, bias, bits, silu_mul)
    want = reference(x, weight, scale, bits, bias, silu_mul)
    assert got.shape == want.shape
    if rows:
        assert (got.double() - want).abs().max() <= 1e-4 * (1 + want.abs().max())


@pytest.mark.parametrize("kernel", ["block_linear", "lane_linear"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_kernel_at_the_extremes_of_its_sums(kernels, kernel, rows, sign):
    """Every nibble 15 against every activation at +-127 (the largest partial sums a kernel
    holds, in int16 where the one-row kernel sums a block's lanes), and every nibble 0 (the
    largest offset): float32's rounding of the exact sums."""
    k = 1056  # 33 blocks: two groups of 16 and a last, partial one
    nibbles = torch.tensor([0xFF, 0x00, 0x0F, 0xF0], dtype=torch.uint8).repeat_interleave(64).repeat(k // 256 + 2)
    weight = torch.stack([nibbles[i:i + k // 2] for i in range(0, 256, 16)])
    scale = torch.ones(16, k // 32, dtype=torch.float16)
    x = torch.full((rows, k), sign)
    got, want = getattr(kernels, kernel)(x, weight, scale, None, 4, False), reference(x, weight, scale, 4)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_the_two_kernels_agree_in_bfloat16(kernels, bits):
    """The same math summed in another order: bfloat16 outputs within one rounding step."""
    torch.manual_seed(bits)
    weight, scale = (quantize_q4_0 if bits == 4 else quantize_q8_0)(torch.randn(96, 1024) * 0.05)
    x = torch.randn(16, 1024).bfloat16()
    a = kernels.block_linear(x, weight, scale, None, bits, True).float()
    b = kernels.lane_linear(x, weight, scale, None, bits, True).float()
    assert a.dtype == b.dtype and (a - b).abs().le(a.abs() * 2 ** -7 + 1e-6).all()
    assert (a == b).float().mean() > 0.9


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_is_the_formats_own(kernels, bits):
    weight, scale = (quantize_q4_0 if bits == 4 else quantize_q8_0)(torch.randn(70, 1024))
    dequantized = (dequantize_q4_0 if bits == 4 else dequantize_q8_0)(weight, scale, torch.float32)
    assert torch.equal(kernels.block_dequantize(weight, scale, bits, torch.float32), dequantized)
    assert torch.equal(kernels.block_dequantize(weight, scale, bits, torch.bfloat16), dequantized.bfloat16())


@pytest.mark.parametrize("kernel", ["block_linear", "lane_linear"])
def test_kernel_refuses_a_wrong_scale(kernels, kernel):
    weight, scale = quantize_q4_0(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="float16 block scales"):
        getattr(kernels, kernel)(torch.randn(1, 64), weight, scale.float(), None, 4, False)


def test_lane_linear_refuses_an_unknown_format(kernels):
    weight, scale = quantize_q4_0(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="format 4 .Q4_0., 8 .Q8_0. or 1"):
        kernels.lane_linear(torch.randn(1, 64), weight, scale, None, 5, False)


@pytest.mark.parametrize("fmt", ["int4", "q8_0"])
def test_the_kernels_path_is_chosen_and_keeps_greedy_tokens(fmt, tmp_path_factory):
    source, _ = dequantized_checkpoint(fmt, "llama", tmp_path_factory)
    prompts = [random_prompt(n, 900 + n) for n in (5, 17, 40)]
    fast = make_llm(source, quantization=fmt, dtype="bfloat16", enforce_eager=False)
    described = fast.llm_engine.engine_core.model_runner.backend.describe()
    if compiled_kernels().module.block_linear_available():
        from fast.block_linear import INT4_DOT_ROWS, Q8_0_DOT_ROWS
        most = INT4_DOT_ROWS if fmt == "int4" else Q8_0_DOT_ROWS
        first = f"1-{most} rows" if most > 1 else "1 row"
        assert f"{fmt} linears: {first} block_linear (VNNI, int8 activations), {most + 1}+ rows lane_linear" in described, described
    else:  # said, and the plain path's math runs them
        assert "built without AVX-512 VNNI" in described, described
    plain = make_llm(source, quantization=fmt, dtype="bfloat16", fast_paths=False)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, greedy(6), use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(6), use_tqdm=False)]
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 2, (got, want)
