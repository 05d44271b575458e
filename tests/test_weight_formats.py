"""A weight format is one object (core/weight_format.py), registered by one line (core/formats.py).

* model.py asks the format: it tests no dtype, no parameter-name suffix, no quantized class;
* a format defined here, registered with one line, loads a checkpoint on every path and gives
  the tokens of the plain model on its dequantized weights -- a trivial one (float16 storage)
  and a packed one whose stored weight is not ``[out, in]`` (4-bit values two per byte, a scale
  per block of 32), through fused q/k/v and gate/up slices, tied embeddings and
  ``load_weights`` after start-up;
* the fast layer chooses each linear's kernel per row count once, and ``describe()`` prints it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from core import formats
from core.weight_format import WeightFormat
from fast.format_kernels import FormatLinearKernel, RowKernels
from fast.int8_linear import INT8_LANE_FROM, INT8_ROWS, Int8Kernels
from fast.kernels import compiled_kernels
from helpers import GreedyReference, build_checkpoint, greedy, make_llm, random_prompt
from model import FormatLinear, Linear

MODEL_PY = Path(__file__).resolve().parent.parent / "model.py"
PATHS = {"plain": dict(fast_paths=False), "eager": dict(enforce_eager=True), "kernels": {}}


# ----------------------------------------------------------------------------- model.py asks

def code_of(tree: ast.AST):
    """Every node of ``tree`` but docstrings (prose may name a format)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node for node in ast.walk(tree) if id(node) not in docstrings]


FORMAT_WORDS = ("int8", "int4", "_scale", "quantize_rows", "is_floating_point")  # in any name
FORMAT_CLASSES = ("Format", "Int8", "Quant")  # in an isinstance's class


def offending(node: ast.AST) -> str | None:
    """What in ``node`` tests a format's dtype, a parameter's name or a quantized class."""
    name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
            else node.name if isinstance(node, (ast.ClassDef, ast.FunctionDef)) else "")
    if any(word in name.lower() for word in FORMAT_WORDS):
        return name
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
            "int8" in node.value or "_scale" in node.value):
        return repr(node.value)
    if not isinstance(node, ast.Call):
        return None
    func = ast.unparse(node.func)
    if func == "isinstance" and any(word in ast.unparse(node.args[1]) for word in FORMAT_CLASSES):
        return ast.unparse(node)
    if func.endswith(".endswith") and ast.unparse(node.args[0]) != "_IGNORED_SUFFIXES":
        return ast.unparse(node)  # only the rotary tables a checkpoint may carry are told by name
    return None


def test_model_py_tests_no_dtype_suffix_or_quantized_class():
    """No int8 / 4-bit dtype or scale parameter named, no dtype test (``is_floating_point``),
    no suffix test but the rotary tables', no isinstance on a format's class: model.py asks
    the format."""
    offenders = [f"line {node.lineno}: {what}" for node in code_of(ast.parse(MODEL_PY.read_text()))
                 if (what := offending(node)) is not None]
    assert not offenders, offenders


# ----------------------------------------------------------------------------- formats of a test

class Float16Weights(WeightFormat):
    """Weights stored in float16: the least a format can be."""

    name = "test_fp16"

    def create_weights(self, rows, columns, dtype, device):
        return {"weight": nn.Parameter(torch.empty(rows, columns, dtype=torch.float16, device=device),
                                       requires_grad=False)}

    def quantize(self, weight):
        return {"weight": weight.to(torch.float16)}

    def dequantize(self, stored, dtype):
        return stored["weight"].to(dtype)


class Packed4Bit(WeightFormat):
    """Q4_0-like: per block of 32 inputs a float32 scale (the block's largest |value| / 7) and
    4-bit values (+8, in 0..15) packed two per byte: ``weight`` uint8 [out, in / 2] and
    ``weight_scale`` [out, in / 32] -- a stored weight that is not [out, in]."""

    name = "test_packed4"
    parameters = ("weight", "weight_scale")
    BLOCK = 32

    def create_weights(self, rows, columns, dtype, device):
        def empty(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        return {"weight": empty(rows, columns // 2, dtype=torch.uint8),
                "weight_scale": empty(rows, columns // self.BLOCK, dtype=torch.float32)}

    def quantize(self, weight):
        blocks = weight.detach().float().unflatten(1, (-1, self.BLOCK))
        scale = blocks.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny) / 7
        values = (torch.round(blocks / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).flatten(1)
        return {"weight": values[:, 0::2] | (values[:, 1::2] << 4), "weight_scale": scale}

    def dequantize(self, stored, dtype):
        packed, scale = stored["weight"], stored["weight_scale"]
        values = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float() - 8
        return (values.unflatten(-1, (-1, self.BLOCK)) * scale[..., None]).flatten(-2).to(dtype)


TEST_FORMATS = {"fp16": Float16Weights(), "packed4": Packed4Bit()}


@pytest.fixture(params=list(TEST_FORMATS))
def test_format(request, monkeypatch):
    weight_format = TEST_FORMATS[request.param]
    monkeypatch.setitem(formats.FORMATS, weight_format.name, weight_format)  # the one line
    return weight_format


def dequantized_checkpoint(source: str, weight_format: WeightFormat, out_dir: str) -> str:
    """``source`` with every matrix replaced by its round trip through ``weight_format``: what
    an engine in that format computes, as Hugging Face runs it."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.copy_(weight_format.dequantize(weight_format.quantize(param), torch.float32))
    model.save_pretrained(out_dir)
    return out_dir


_BUILT: dict = {}


def checkpoints(arch: str, weight_format: WeightFormat, factory) -> tuple[str, str]:
    key = (arch, weight_format.name)
    if key not in _BUILT:
        folder = factory.mktemp(f"{arch}_{weight_format.name}")
        source = _BUILT.get(arch) or build_checkpoint(arch, str(folder / "source"))
        _BUILT[arch] = source
        _BUILT[key] = source, dequantized_checkpoint(source, weight_format, str(folder / "dequantized"))
    return _BUILT[key]


@pytest.mark.parametrize("arch", ["llama3_tied", "qwen3"])
@pytest.mark.parametrize("path", PATHS)
def test_a_registered_format_gives_the_tokens_of_its_dequantized_weights(arch, path, test_format,
                                                                          tmp_path_factory):
    source, dequantized = checkpoints(arch, test_format, tmp_path_factory)
    prompts = [random_prompt(n, 700 + n) for n in (6, 23)]
    llm = make_llm(source, quantization=test_format.name, **PATHS[path])
    model = llm.llm_engine.model
    assert model.quantization == test_format.name
    assert isinstance(model.layers[0].mlp.gate_up_proj, FormatLinear)
    if arch == "llama3_tied":
        assert model.lm_head.weight is model.embed_tokens.weight  # the head shares the stored rows
    got = llm.generate(prompts, greedy(10), use_tqdm=False)
    GreedyReference(dequantized).compare_all(prompts, got, 10)


def test_load_weights_after_start_up_goes_through_the_format(test_format, tmp_path):
    """q/k/v and gate/up slices of a packed weight, and its scales, written by the format."""
    from safetensors.torch import load_file
    first = build_checkpoint("qwen3", str(tmp_path / "a"), seed=1)
    second = build_checkpoint("qwen3", str(tmp_path / "b"), seed=2)
    prompts = [random_prompt(9, 740), random_prompt(21, 741)]
    fresh = make_llm(second, quantization=test_format.name)
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy(8), use_tqdm=False)]
    llm = make_llm(first, quantization=test_format.name)
    llm.generate(prompts, greedy(8), use_tqdm=False)
    filled = llm.llm_engine.model.load_weights(load_file(f"{second}/model.safetensors").items())
    assert "layers.0.self_attn.qkv_proj.weight" in filled
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
    assert got == want
    with pytest.raises(ValueError, match=r"has shape \(3, 64\), expected \(128, 64\)"):
        llm.llm_engine.model.load_weights([("model.layers.0.self_attn.q_proj.weight",
                                            torch.zeros(3, 64))])


def test_a_format_without_kernels_says_what_computes_its_linears(llama_dir, monkeypatch):
    weight_format = TEST_FORMATS["packed4"]
    monkeypatch.setitem(formats.FORMATS, weight_format.name, weight_format)
    llm = make_llm(llama_dir, quantization=weight_format.name)
    described = llm.llm_engine.engine_core.model_runner.backend.describe()
    assert "test_packed4 linears: any rows dequantized matmul (9)" in described


# ----------------------------------------------------------------------------- kernels, chosen once

def test_row_kernels_table_and_description():
    def span(most, name):
        return most, name, lambda part, x, fused: name
    few, mm = span(3, "few"), span(None, "mm")
    tiles = RowKernels([few, span(128, "tiles"), mm])
    assert tiles.describe() == "1-3 rows few, 4-128 rows tiles, 129+ rows mm"
    for rows, want in ((0, "few"), (1, "few"), (3, "few"), (4, "tiles"), (128, "tiles"), (129, "mm"),
                       (5000, "mm")):
        assert tiles.kernel(torch.empty(rows, 2))(None, None, False) == want, rows
    assert tiles.kernel(torch.empty(2, 3, 4))(None, None, False) == "mm"  # not rows: the matmul
    off = RowKernels([few, span(0, "tiles"), mm])  # a span that covers no row count
    assert off.describe() == "1-3 rows few, 4+ rows mm"
    assert off.kernel(torch.empty(4, 2))(None, None, False) == "mm"
    assert RowKernels([mm]).describe() == "any rows mm"


@pytest.fixture(scope="module")
def int8_kernels():
    module = compiled_kernels().module
    if module is None or not module.int8_linear_available():
        pytest.skip("no 8-bit kernels in this build (no AVX-512)")
    return module


class Counting:
    def __init__(self, module):
        self.module, self.calls = module, []

    def __getattr__(self, name):
        kernel = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return kernel(*args, **kwargs)
        return counted


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_rows_go_to_the_kernel_chosen_for_them(int8_kernels, dtype, lanes):
    """Without AMX tiles: bfloat16 rows, one the few-row kernel, more lane_linear (where VNNI
    is built), or without VNNI up to INT8_ROWS the few-row kernel, more the dequantized matmul;
    float32 rows the few-row kernel at every row count (a row's bits at any count), equal to its
    rows one at a time."""
    if lanes and not int8_kernels.lane_linear_available():
        pytest.skip("built without AVX-512 VNNI: no lane kernel here")
    lanes = lanes and dtype == torch.bfloat16
    part = FormatLinear.of(Linear(64, 32).to(dtype), formats.FORMATS["int8"])
    counting = Counting(int8_kernels)
    replacement = FormatLinearKernel(Int8Kernels(counting, lanes=lanes), part, dtype)
    if dtype == torch.float32:
        assert replacement.describe() == "any rows int8_linear (any rows, 8 at a time)"
        x = torch.randn(40, 64)
        with torch.inference_mode():
            whole = replacement(part, x)
            alone = torch.cat([replacement(part, x[i:i + 1]) for i in range(40)])
        assert torch.equal(whole, alone)
        assert set(counting.calls) == {"int8_linear"}
    else:
        few = INT8_LANE_FROM - 1 if lanes else INT8_ROWS
        more = "lane_linear (VNNI, int8 activations)" if lanes else "int8_dequantize + matmul"
        assert replacement.describe() == (f"1 row int8_linear, {few + 1}+ rows {more}" if few == 1
                                          else f"1-{few} rows int8_linear, {few + 1}+ rows {more}")
        for rows in (1, few, few + 1, 40):
            counting.calls.clear()
            with torch.inference_mode():
                replacement(part, torch.randn(rows, 64).to(dtype))
            want = "int8_linear" if rows <= few else "lane_linear" if lanes else "int8_dequantize"
            assert counting.calls == [want], rows
    strided = part.weight.detach().t().contiguous().t()  # [32, 64], not contiguous
    part.weight = nn.Parameter(strided, requires_grad=False)
    with torch.inference_mode():
        replacement(part, torch.randn(2, 64).to(dtype))
    assert replacement.describe() == "any rows dequantized matmul (model.py)"  # chosen again, for it


def test_each_int8_linear_chooses_once_and_describe_prints_it(int8_kernels, llama_dir, monkeypatch):
    chosen = []
    original = Int8Kernels.choose
    monkeypatch.setattr(Int8Kernels, "choose",
                        lambda self, part, dtype: chosen.append(part) or original(self, part, dtype))
    llm = make_llm(llama_dir, dtype="bfloat16", quantization="int8")
    backend = llm.llm_engine.engine_core.model_runner.backend
    linears = {name: part for name, part in llm.llm_engine.model.replaceable_parts()
               if isinstance(part, FormatLinear)}
    assert len(linears) == 9 and sorted(map(id, chosen)) == sorted(map(id, linears.values()))
    for batch in (1, 5, 12):
        llm.generate([random_prompt(7 + i, 760 + i) for i in range(batch)], greedy(4), use_tqdm=False)
    assert len(chosen) == 9, "a kernel chosen again on a call"
    rows = {backend.replacements[name].describe() for name in linears}
    assert len(rows) == 1
    assert f"int8 linears: {rows.pop()} (9)" in backend.describe()
    plain = make_llm(llama_dir, dtype="bfloat16", quantization="int8", fast_paths=False)
    assert plain.llm_engine.engine_core.model_runner.backend.describe() == (
        "plain (int8 linears: any rows dequantized matmul (9))")
