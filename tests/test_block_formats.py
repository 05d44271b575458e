"""The block formats of llama.cpp's kind: 4-bit (``quantization="int4"``, Q4_0's layout) and
``"q8_0"`` (Q8_0's), blocks of 32 inputs with one float16 scale each.

The spec is the checkpoint with each weight replaced by its dequantized value, run by Hugging
Face in float32: the plain path and the fast path without kernels give exactly its tokens. The
compiled kernels (fast/csrc/block_linear.cpp, lane_linear.cpp) quantize the activations per
block of 32 to 8 bits as llama.cpp does, so they are held to the same math done in float64
(``reference``), and their engine's greedy tokens to the plain path's on these checkpoints.
int4's parameters hold Q4_0's rows interleaved by 16 (core/int4_format.py): the kernels take
them so (``as_stored``), the reference and ``stored`` in GGUF's order.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.formats import FORMATS
from core.int4_format import (GROUP, Int4Format, dequantize_q4_0, interleave_q4_0, quantize_q4_0,
                               rows_from_groups, rows_in_groups, unpack_q4_0)
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


# ----------------------------------------------------------------------------- int4's stored order

@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 70])
def test_interleaved_rows_are_the_documented_layout(rows):
    """Group g (16 rows, the last fewer), block b, word j, row i of the group: the 4 bytes of row
    16g + i at columns 4(4b + j).. (a block's 16 bytes are four words); scales: one per block."""
    torch.manual_seed(rows)
    packed, scale = quantize_q4_0(torch.randn(rows, 96))
    weight, scales = interleave_q4_0(packed, scale)
    assert weight.shape == packed.shape and scales.shape == scale.shape
    flat, flat_scales, at, at_scale = weight.flatten(), scales.flatten(), 0, 0
    for g in range(0, rows, GROUP):
        count = min(GROUP, rows - g)
        for b in range(3):
            for j in range(4):
                for i in range(count):
                    assert torch.equal(flat[at:at + 4], packed[g + i, 16 * b + 4 * j:16 * b + 4 * j + 4])
                    at += 4
            assert torch.equal(flat_scales[at_scale:at_scale + count], scale[g:g + count, b])
            at_scale += count
    assert torch.equal(rows_from_groups(weight, 4), packed) and torch.equal(rows_from_groups(scales, 1), scale)


@pytest.mark.parametrize("rows", [slice(0, 40), slice(5, 23), slice(16, 32), slice(33, 40), slice(39, 40)])
def test_loading_some_rows_writes_those_rows_only(rows):
    """A fused slice (q, k or v of a qkv weight) lands in the rows it names, whatever groups of 16
    it shares; every other row keeps its bytes; a tensor given as stored is GGUF-ordered."""
    torch.manual_seed(1)
    fmt, part = Int4Format(), torch.nn.Module()
    for name, param in fmt.create_weights(40, 64, torch.float32, torch.device("cpu")).items():
        part.register_parameter(name, param)
    before = fmt.quantize(torch.randn(40, 64))
    with torch.no_grad():
        part.weight.copy_(rows_in_groups(before["weight"], 4))
        part.weight_scale.copy_(rows_in_groups(before["weight_scale"], 1))
        version = part.weight._version
        new = torch.randn(len(range(40)[rows]), 64)
        fmt.load(part, "weight", new, rows)
    assert part.weight._version > version
    want = {name: value.clone() for name, value in before.items()}
    for name, value in fmt.quantize(new).items():
        want[name][rows] = value
    assert all(torch.equal(fmt.stored(part)[name], want[name]) for name in want)
    assert torch.equal(fmt.dequantize(fmt.stored(part, rows), torch.float32),
                       fmt.dequantize(fmt.quantize(new), torch.float32))
    with torch.no_grad():  # as stored: GGUF-ordered blocks and scales, as a GGUF file gives them
        fmt.load(part, "weight", before["weight"][rows], rows)
        fmt.load(part, "weight_scale", before["weight_scale"][rows], rows)
    assert all(torch.equal(fmt.stored(part)[name], before[name]) for name in before)


@pytest.mark.parametrize("fmt", ["int4", "q8_0", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_weights_after_start_up_gives_a_fresh_loads_tokens(fmt, dtype, tmp_path):
    """q/k/v and gate/up slices written after start-up (into int4's interleaved rows too): the
    tokens are a fresh load's, with the fast layer's kernels. A float weight is quantized as the
    model's dtype holds it, as a fresh load quantizes it (before, in bfloat16, load_weights
    quantized the checkpoint's float32 values and the tokens drifted)."""
    from safetensors.torch import load_file
    first = build_checkpoint("qwen3", str(tmp_path / "a"), seed=1)
    second = build_checkpoint("qwen3", str(tmp_path / "b"), seed=2)
    prompts = [random_prompt(9, 740), random_prompt(21, 741)]
    want = [o.outputs[0].token_ids for o in make_llm(second, quantization=fmt, dtype=dtype).generate(
        prompts, greedy(8), use_tqdm=False)]
    llm = make_llm(first, quantization=fmt, dtype=dtype)
    llm.generate(prompts, greedy(8), use_tqdm=False)
    filled = llm.llm_engine.model.load_weights(load_file(f"{second}/model.safetensors").items())
    assert "layers.0.self_attn.qkv_proj.weight" in filled and "layers.0.mlp.gate_up_proj.weight" in filled
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)] == want


# ----------------------------------------------------------------------------- the kernel

@pytest.fixture(scope="module")
def kernels():
    module = compiled_kernels().module
    assert module is not None, compiled_kernels().reason
    if not module.block_linear_available():
        pytest.skip("this CPU has no AVX-512 VNNI: the block kernels are not built here")
    return module


def as_stored(bits, weight, scale):
    """A quantizer's rows as the format's parameters hold them, which the kernels read."""
    return interleave_q4_0(weight, scale) if bits == 4 else (weight, scale)


def reference(x, weight, scale, bits, bias=None, silu_mul=False):
    """The kernel's math in float64 (weight and scale in GGUF's order): activations per block of 32 to int8 (max|x| / 127, round
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
    """70 weight rows (64 for a Q4_0 gate/up pair, whose up rows start a group of 16): the
    groups of 16 end in a partial one (35 rows of a Q8_0 gate/up pair)."""
    torch.manual_seed(k + rows)
    n = 64 if bits == 4 and silu_mul else 70
    weight, scale = (quantize_q4_0 if bits == 4 else quantize_q8_0)(torch.randn(n, k))
    x, bias = torch.randn(rows, k), torch.randn(n)
    got = getattr(kernels, kernel)(x, *as_stored(bits, weight, scale), bias, bits, silu_mul)
    want = reference(x, weight, scale, bits, bias, silu_mul)
    assert got.shape == want.shape
    if rows:
        assert (got.double() - want).abs().max() <= 1e-4 * (1 + want.abs().max())


@pytest.mark.parametrize("silu_mul", [False, True])
def test_an_int4_row_is_the_same_bits_at_any_row_count(kernels, silu_mul):
    """int4 runs one kernel at every row count, each input row summed block by block alike,
    read in place or from a copy: a row's output does not depend on the rows beside it."""
    torch.manual_seed(5)
    weight, scale = as_stored(4, *quantize_q4_0(torch.randn(96, 1056) * 0.05))
    x = torch.randn(40, 1056).bfloat16()
    alone = torch.cat([kernels.block_linear(x[i:i + 1], weight, scale, None, 4, silu_mul) for i in range(40)])
    for rows in (2, 5, 16, 17, 40):
        together = torch.cat([kernels.block_linear(x[i:i + rows], weight, scale, None, 4, silu_mul)
                              for i in range(0, 40, rows)])
        assert torch.equal(together, alone), rows


@pytest.mark.parametrize("kernel", ["block_linear", "lane_linear"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_kernel_at_the_extremes_of_its_sums(kernels, kernel, rows, sign):
    """Every nibble 15 against every activation at +-127 (the largest partial sums a kernel
    holds), and every nibble 0 (the largest offset): float32's rounding of the exact sums."""
    k = 1056  # 33 blocks: two groups of 16 and a last, partial one
    nibbles = torch.tensor([0xFF, 0x00, 0x0F, 0xF0], dtype=torch.uint8).repeat_interleave(64).repeat(k // 256 + 2)
    weight = torch.stack([nibbles[i:i + k // 2] for i in range(0, 256, 16)])
    scale = torch.ones(16, k // 32, dtype=torch.float16)
    x = torch.full((rows, k), sign)
    got = getattr(kernels, kernel)(x, *as_stored(4, weight, scale), None, 4, False)
    want = reference(x, weight, scale, 4)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_the_two_kernels_agree_in_bfloat16(kernels, bits):
    """The same math summed in another order: bfloat16 outputs within one rounding step."""
    torch.manual_seed(bits)
    weight, scale = as_stored(bits, *(quantize_q4_0 if bits == 4 else quantize_q8_0)(torch.randn(96, 1024) * 0.05))
    x = torch.randn(16, 1024).bfloat16()
    a = kernels.block_linear(x, weight, scale, None, bits, True).float()
    b = kernels.lane_linear(x, weight, scale, None, bits, True).float()
    assert a.dtype == b.dtype and (a - b).abs().le(a.abs() * 2 ** -7 + 1e-6).all()
    assert (a == b).float().mean() > 0.9


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_is_the_formats_own(kernels, bits):
    weight, scale = (quantize_q4_0 if bits == 4 else quantize_q8_0)(torch.randn(70, 1024))
    dequantized = (dequantize_q4_0 if bits == 4 else dequantize_q8_0)(weight, scale, torch.float32)
    weight, scale = as_stored(bits, weight, scale)
    assert torch.equal(kernels.block_dequantize(weight, scale, bits, torch.float32), dequantized)
    assert torch.equal(kernels.block_dequantize(weight, scale, bits, torch.bfloat16), dequantized.bfloat16())


@pytest.mark.parametrize("kernel", ["block_linear", "lane_linear"])
def test_kernel_refuses_a_wrong_scale(kernels, kernel):
    weight, scale = quantize_q4_0(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="float16 block scales"):
        getattr(kernels, kernel)(torch.randn(1, 64), weight, scale.float(), None, 4, False)


@pytest.mark.parametrize("kernel", ["block_linear", "lane_linear"])
def test_a_q4_0_gate_off_a_group_of_16_is_refused(kernels, kernel):
    """Its up rows would start inside a group of 16: refused naming why (a model's are never so:
    int4 needs the intermediate size, the down projection's columns, a multiple of 32)."""
    weight, scale = interleave_q4_0(*quantize_q4_0(torch.randn(40, 64)))
    with pytest.raises(RuntimeError, match="whole groups of 16"):
        getattr(kernels, kernel)(torch.randn(1, 64), weight, scale, None, 4, True)


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
    if compiled_kernels().module.block_linear_available() and fmt == "int4":
        assert "int4 linears: any rows lane_linear (VNNI, 16 weight rows in the lanes, as stored)" in described, described
    elif compiled_kernels().module.block_linear_available():
        from fast.block_linear import Q8_0_DOT_ROWS
        most = Q8_0_DOT_ROWS
        first = f"1-{most} rows" if most > 1 else "1 row"
        assert f"{fmt} linears: {first} block_linear (VNNI, int8 activations), {most + 1}+ rows lane_linear" in described, described
    else:  # said, and the plain path's math runs them
        assert "built without AVX-512 VNNI" in described, described
    plain = make_llm(source, quantization=fmt, dtype="bfloat16", fast_paths=False)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, greedy(6), use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(6), use_tqdm=False)]
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 2, (got, want)
