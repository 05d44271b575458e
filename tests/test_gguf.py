"""GGUF files loaded as they are (core/gguf.py): ``LLM("file.gguf", tokenizer=...)``.

The files are written here from tiny random Hugging Face checkpoints (tests/gguf_files.py), as
llama.cpp's converter writes them: llama's Q/K rows reordered, a tied head left out.

* float tensors (F32, F16, BF16): the tokens of Hugging Face ``generate`` on the weights the
  file holds (for F32, the original checkpoint), llama (tied and untied), qwen2, qwen3; the
  float weights cast to the requested dtype as transformers casts them;
* Q8_0 and Q4_0 tensors: kept in the q8_0 / int4 formats, their bytes exactly what the formats'
  own quantizers make of the checkpoint (llama.cpp's rounding, GGUF's nibble order); logits
  equal to this engine's on the dequantized weights in float32 (the spec): exactly on the plain
  path, to float rounding on the fast path without kernels, within the activations' 8-bit
  rounding with the block kernels; Hugging Face's tokens on the dequantized checkpoint;
* a file mixing types per tensor: each part in its own tensor's format;
* refusals, each naming what is wrong: a type not loaded (naming it and the tensor), an
  unknown architecture, a truncated file, a missing or an unknown tensor, one fused weight of
  two types, llama 3's rope_freqs, arguments a GGUF file does not take;
* the tokenizer: from the file when transformers can build it (a byte-level BPE, as llama 3
  and Qwen files carry), none when the file has none, a warning when transformers cannot;
  ``tokenizer=`` a folder; nothing beside the file is read.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf_files as G
from core.formats import FORMATS
from core.int4_format import rows_in_groups
from helpers import GreedyReference, assert_within_rounding, build_checkpoint, build_tokenizer, greedy, make_llm, random_prompt
from tools.teacher_forced import teacher_forced_logits

PROMPTS = [random_prompt(n, 800 + n) for n in (5, 17, 40)]
LOGIT_IDS = random_prompt(48, 7)
PATHS = {"plain": dict(fast_paths=False), "eager": dict(enforce_eager=True), "kernels": {}}


@pytest.fixture(scope="module")
def sources(checkpoints, tmp_path_factory) -> dict[str, str]:
    """The conftest checkpoints, and a tied llama (the conftest's tied one uses llama 3 rope
    scaling, which GGUF files keep as a rope_freqs tensor this engine refuses)."""
    tied = build_checkpoint("llama", str(tmp_path_factory.mktemp("llama_tied")), seed=5,
                            tie_word_embeddings=True)
    return {"llama": checkpoints["llama"], "llama_tied": tied, "qwen2": checkpoints["qwen2"],
            "qwen3": checkpoints["qwen3"]}


def logits(llm, ids=LOGIT_IDS, mode="whole") -> torch.Tensor:
    return teacher_forced_logits(llm.llm_engine.engine_core.model_runner.backend, ids, mode)


def model_of(llm):
    return llm.llm_engine.model


# ----------------------------------------------------------------------------- float tensors

@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_files_give_hf_tokens(sources, arch, kind, tmp_path):
    file = G.write_gguf(sources[arch], tmp_path / "m.gguf", G.all_in(kind))
    # F32 holds the checkpoint itself; F16 / BF16 its weights rounded, which HF then runs.
    reference = sources[arch] if kind == "F32" else G.dequantized_checkpoint(
        sources[arch], file, tmp_path / "rounded")
    llm = make_llm(file, fast_paths=kind != "BF16")  # both paths, over the three types
    assert model_of(llm).config.tie_word_embeddings == (arch == "llama_tied")
    ref = GreedyReference(reference)
    ref.compare_all(PROMPTS, llm.generate(PROMPTS, greedy(10), use_tqdm=False), 10)
    assert ref.compared >= 20


@pytest.mark.parametrize("rope", [dict(rope_type="linear", factor=2.0),
                                  dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)])
def test_rope_scaling_in_the_metadata_gives_hf_tokens(rope, tmp_path):
    source = build_checkpoint("qwen3", str(tmp_path / "src"),
                              rope_parameters={"rope_theta": 1000000.0, **rope})
    llm = make_llm(G.write_gguf(source, tmp_path / "m.gguf"))
    assert model_of(llm).config.rope_parameters["rope_type"] == rope["rope_type"]
    prompts = PROMPTS + [random_prompt(150, 9)]  # past the YaRN checkpoint's original context
    GreedyReference(source).compare_all(prompts, llm.generate(prompts, greedy(8), use_tqdm=False), 8)


def test_float_weights_are_cast_to_the_dtype_as_transformers_casts_them(sources, tmp_path):
    """An F32 file in bfloat16: each weight is the checkpoint's, rounded once to bfloat16; the
    llama Q rows back in Hugging Face's order."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(sources["llama"], dtype=torch.float32)
    file = G.write_gguf(sources["llama"], tmp_path / "m.gguf")
    model = model_of(make_llm(file, dtype="bfloat16"))
    layer = hf.model.layers[1]
    qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                     layer.self_attn.v_proj.weight])
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, qkv.bfloat16())
    assert torch.equal(model.norm.weight, hf.model.norm.weight.bfloat16())
    assert model.quantization == "gguf"


def test_the_writers_reordering_is_the_one_transformers_undoes():
    """The test files' Q/K reordering (llama.cpp's converter's) is the one transformers' own
    GGUF loader undoes, and core/gguf.py's ``unpermute`` undoes it the same way (Q: 4 heads,
    K: 2 heads of 32 rows, with a block tensor's bytes per row)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from core.gguf import unpermute

    rows = np.arange(128 * 3, dtype=np.float32).reshape(128, 3)
    for heads in (4, 2):
        written = G.permute(rows, heads)
        assert not np.array_equal(written, rows)
        theirs = LlamaTensorProcessor()._reverse_permute_weights(written, 4, heads)
        assert np.array_equal(theirs, rows)
        assert np.array_equal(unpermute(torch.from_numpy(written), heads).numpy(), rows)


# ----------------------------------------------------------------------------- block tensors

def test_our_block_bytes_are_llama_cpps():
    """The test's quantizer writes what the gguf package's reference quantizer writes (so the
    files below are llama.cpp's bytes): Q8_0 and Q4_0, a zero block and scales over 5 decades."""
    import gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 128)) * np.logspace(-3, 2, 6)[:, None]).astype(np.float32)
    w[2, 32:64] = 0
    for kind in ("Q8_0", "Q4_0"):
        assert np.array_equal(G.quantize(w, kind), gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind,fmt", [("Q8_0", "q8_0"), ("Q4_0", "int4")])
def test_blocks_load_as_the_formats_own_quantizer_stores_them(sources, kind, fmt, tmp_path):
    """Loaded by a view of the file's bytes, each block part holds exactly what its format's
    quantizer makes of the checkpoint's weight: llama.cpp's layout is the format's (the llama
    rows put back, whole blocks moved with their scales), as ``stored`` gives it back; int4's
    parameters hold those bytes with their rows interleaved by 16 (core/int4_format.py)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(sources["llama"], dtype=torch.float32)
    model = model_of(make_llm(G.write_gguf(sources["llama"], tmp_path / "m.gguf", G.all_in(kind))))
    attention, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    checks = {model.layers[0].self_attn.qkv_proj: torch.cat(
                  [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
              model.layers[0].mlp.down_proj: mlp.down_proj.weight,
              model.embed_tokens: hf.model.embed_tokens.weight, model.lm_head: hf.lm_head.weight}
    for part, weight in checks.items():
        assert part.weight_format is FORMATS[fmt]
        want, stored = FORMATS[fmt].quantize(weight), FORMATS[fmt].stored(part)
        assert torch.equal(stored["weight"], want["weight"]) and torch.equal(stored["weight_scale"], want["weight_scale"])
        if part.weight_format is FORMATS["int4"]:
            assert torch.equal(part.weight, rows_in_groups(want["weight"], 4))
            assert torch.equal(part.weight_scale, rows_in_groups(want["weight_scale"], 1))


@pytest.fixture(scope="module")
def block_files(sources, tmp_path_factory) -> dict:
    """(kind, arch) -> (the GGUF file, the checkpoint of its dequantized weights)."""
    out = {}
    for kind in ("Q8_0", "Q4_0"):
        for arch in ("llama", "qwen3"):
            folder = tmp_path_factory.mktemp(f"{kind}_{arch}")
            file = G.write_gguf(sources[arch], folder / "m.gguf", G.all_in(kind))
            out[kind, arch] = file, G.dequantized_checkpoint(sources[arch], file, folder / "spec")
    return out


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_block_files_compute_their_dequantized_weights(block_files, kind, arch):
    """The spec: this engine on the dequantized checkpoint in float32. The plain path equals it
    exactly, the fast path without kernels to float rounding, the block kernels (activations
    rounded to 8 bits per block of 32, as llama.cpp's CPU does) within a small bound; greedy
    tokens are Hugging Face's on the dequantized checkpoint."""
    file, spec = block_files[kind, arch]
    want = logits(make_llm(spec, fast_paths=False))
    want_decode = logits(make_llm(spec, fast_paths=False), mode="decode")
    plain = make_llm(file, **PATHS["plain"])
    assert torch.equal(logits(plain), want)
    assert (logits(make_llm(file, **PATHS["eager"])) - want).abs().max() <= 1e-5 * want.abs().max()
    kernels = make_llm(file, **PATHS["kernels"])
    got = logits(kernels, mode="decode")  # one row a step: the few-row kernel where built
    assert_within_rounding(got, want_decode)  # activations rounded to 8 bits per block
    ref = GreedyReference(spec)
    ref.compare_all(PROMPTS, plain.generate(PROMPTS, greedy(10), use_tqdm=False), 10)
    assert ref.compared >= 20


def test_the_block_kernels_run_the_files_parts(block_files):
    from fast.kernels import compiled_kernels

    described = make_llm(block_files["Q4_0", "qwen3"][0]).llm_engine.engine_core.model_runner.backend.describe()
    if compiled_kernels().module.block_linear_available():
        assert "int4 linears: any rows lane_linear (VNNI, 16 weight rows in the lanes, as stored)" in described, described
    else:
        assert "built without AVX-512 VNNI" in described, described


MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
         "ffn_gate": "F16", "ffn_up": "F16", "ffn_down": "Q4_0", "token_embd": "Q8_0",
         "output": "BF16"}


def mixed(name: str, array) -> str:
    return "F32" if array.ndim == 1 else MIXED[name.split(".")[-2]]


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_each_part_takes_its_own_tensors_type(sources, arch, tmp_path):
    file = G.write_gguf(sources[arch], tmp_path / "m.gguf", mixed)
    spec = G.dequantized_checkpoint(sources[arch], file, tmp_path / "spec")
    llm = make_llm(file, fast_paths=False)
    model, layer = model_of(llm), model_of(llm).layers[1]
    assert layer.self_attn.qkv_proj.weight_format is FORMATS["int4"]
    assert layer.self_attn.o_proj.weight_format is FORMATS["q8_0"]
    assert layer.mlp.down_proj.weight_format is FORMATS["int4"]
    assert not hasattr(layer.mlp.gate_up_proj, "weight_format")  # F16: the float model
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.embed_tokens.weight_format is FORMATS["q8_0"]
    if arch == "llama_tied":  # the head is the Q8_0 embedding's parameters
        assert model.lm_head.weight is model.embed_tokens.weight
    else:
        assert model.lm_head.weight.dtype == torch.float32  # BF16, cast to the model's dtype
    want = logits(make_llm(spec, fast_paths=False))
    assert torch.equal(logits(llm), want)
    ref = GreedyReference(spec)
    ref.compare_all(PROMPTS, make_llm(file, **PATHS["eager"]).generate(PROMPTS, greedy(8), use_tqdm=False), 8)
    assert_within_rounding(logits(make_llm(file)), want)  # the kernels: activations rounded per block


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("kind,size", [("Q4_1", 128), ("Q6_K", 256)])
def test_a_type_not_loaded_is_refused_naming_it_and_the_tensor(kind, size, tmp_path):
    source = build_checkpoint("qwen3", str(tmp_path / "src"), intermediate_size=size)
    types = lambda name, a: kind if name == "blk.1.ffn_down.weight" else G.all_in("F32")(name, a)
    with pytest.raises(ValueError, match=rf"tensor blk\.1\.ffn_down\.weight is {kind}; this engine "
                                         r"loads F32, F16, BF16, Q8_0, Q4_0 tensors only"):
        make_llm(G.write_gguf(source, tmp_path / "m.gguf", types))


def test_an_unknown_architecture_is_refused_naming_it(sources, tmp_path):
    with pytest.raises(ValueError, match=r"architecture 'gemma' is not supported \(supported: "
                                         r"llama, qwen2, qwen3\)"):
        make_llm(G.write_gguf(sources["llama"], tmp_path / "m.gguf", arch="gemma"))


def test_a_truncated_file_is_refused_naming_it(sources, tmp_path):
    file = G.write_gguf(sources["qwen3"], tmp_path / "m.gguf")
    data = file.read_bytes()
    for cut in (len(data) - 1000, 200):  # in the tensors, in the metadata
        file.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cannot read GGUF file .*m\.gguf.*damaged or cut short"):
            make_llm(file)


def test_a_missing_tensor_is_refused_naming_it(sources, tmp_path):
    file = G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"m\.gguf lacks tensors: blk\.1\.ffn_up\.weight"):
        make_llm(file)


def test_a_tensor_no_model_reads_is_refused_naming_it(sources, tmp_path):
    extra = {"blk.0.attn_qkv.weight": np.zeros((4, 64), np.float32)}
    with pytest.raises(ValueError, match=r"holds tensors no Qwen3ForCausalLM here reads: "
                                         r"blk\.0\.attn_qkv\.weight"):
        make_llm(G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", extra=extra))


def test_a_layer_past_the_block_count_is_refused_naming_it(sources, tmp_path):
    extra = {"blk.2.ffn_up.weight": np.zeros((128, 64), np.float32)}
    with pytest.raises(ValueError, match=r"reads: blk\.2\.ffn_up\.weight"):
        make_llm(G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", extra=extra))


def test_a_block_type_on_a_vector_is_refused(sources, tmp_path):
    types = lambda name, a: "Q8_0" if name == "output_norm.weight" else G.all_in("F32")(name, a)
    with pytest.raises(ValueError, match=r"tensor output_norm\.weight is Q8_0 but not a matrix"):
        make_llm(G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", types))


def test_llama3_rope_factors_are_refused(sources, tmp_path):
    extra = {"rope_freqs.weight": np.ones(16, np.float32)}
    with pytest.raises(ValueError, match=r"rope_freqs\.weight \(llama 3's rope scaling"):
        make_llm(G.write_gguf(sources["llama"], tmp_path / "m.gguf", extra=extra))


def test_one_fused_weight_of_two_types_is_refused(sources, tmp_path):
    types = lambda name, a: "Q8_0" if name == "blk.0.attn_k.weight" else G.all_in("Q4_0")(name, a)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight Q4_0, blk\.0\.attn_k\.weight "
                                         r"Q8_0, blk\.0\.attn_v\.weight Q4_0 are one fused weight"):
        make_llm(G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", types))


def test_a_shape_that_disagrees_with_the_metadata_names_the_tensor(sources, tmp_path):
    extra_rows = {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}
    file = G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", skip=("blk.0.attn_q_norm.weight",),
                        extra=extra_rows)
    with pytest.raises(ValueError, match=r"tensor blk\.0\.attn_q_norm\.weight \(F32\): weight "
                                         r"layers\.0\.self_attn\.q_norm\.weight has shape \(16,\)"):
        make_llm(file)


@pytest.mark.parametrize("arguments,message", [
    (dict(quantization="int8"), r"quantization='int8': a GGUF file's tensors keep the types"),
    (dict(hf_overrides={"num_hidden_layers": 1}), r"hf_overrides are not applied to a GGUF file"),
    (dict(load_format="dummy"), r"load_format='dummy' does not read a GGUF file"),
])
def test_arguments_a_gguf_file_does_not_take_are_refused(sources, arguments, message, tmp_path):
    file = G.write_gguf(sources["qwen3"], tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=message):
        make_llm(file, **arguments)
    assert model_of(make_llm(file, quantization="gguf", load_format="gguf")).quantization == "gguf"


def test_gguf_names_only_files(sources, tmp_path):
    with pytest.raises(ValueError, match=r"quantization='gguf' reads a GGUF file, but model"):
        make_llm(sources["qwen3"], quantization="gguf")
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ValueError, match=r"is a file but not a GGUF file"):
        make_llm(other)


# ----------------------------------------------------------------------------- the tokenizer

def bpe_tokenizer() -> tuple:
    """A byte-level BPE tokenizer (as llama 3 and Qwen files carry: tokenizer.ggml.model
    "gpt2"), trained here, and its GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "a paged prefix cache hashes each "
              "block once", "def f(x): return x * 2"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    tokens = sorted(fast.get_vocab(), key=fast.get_vocab().get)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]  # 3: control
    return fast, dict(model="gpt2", pre="qwen2", tokens=tokens, merges=merges, types=types, bos=1, eos=2)


TEXTS = ["the quick brown fox", "a paged prefix cache hashes", "def f(x): return x*2 !"]


def test_the_tokenizer_comes_from_the_file(sources, tmp_path):
    original, metadata = bpe_tokenizer()
    file = G.write_gguf(sources["qwen2"], tmp_path / "m.gguf", tokenizer=metadata)
    llm = make_llm(file)
    tokenizer = llm.get_tokenizer()
    assert [tokenizer(t)["input_ids"] for t in TEXTS] == [original(t)["input_ids"] for t in TEXTS]
    by_text = llm.generate(TEXTS, greedy(6), use_tqdm=False)
    by_ids = llm.generate([original(t)["input_ids"] for t in TEXTS], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert by_text[0].outputs[0].text == tokenizer.decode(by_text[0].outputs[0].token_ids)
    assert llm.llm_engine.eos_token_ids == {2}  # the file's tokenizer.ggml.eos_token_id
    hf = llm.llm_engine.model_config.hf_config  # vLLM's view: the config the metadata built
    assert (type(hf).__name__, hf.num_key_value_heads, hf.num_hidden_layers) == ("Qwen2Config", 1, 2)


def test_a_file_without_a_tokenizer_runs_on_token_ids(sources, tmp_path):
    llm = make_llm(G.write_gguf(sources["qwen3"], tmp_path / "m.gguf"))
    assert llm.get_tokenizer() is None
    assert len(llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="You cannot pass text prompts"):
        llm.generate("w5 w6", greedy(3), use_tqdm=False)


def test_a_tokenizer_transformers_cannot_build_is_said(sources, tmp_path):
    _, metadata = bpe_tokenizer()
    file = G.write_gguf(sources["qwen3"], tmp_path / "m.gguf", tokenizer={**metadata, "model": "none-such"})
    with pytest.warns(UserWarning, match=r"transformers cannot build its tokenizer .*pass "
                                         r"tokenizer=<a tokenizer folder>"):
        llm = make_llm(file)
    assert llm.get_tokenizer() is None


def test_tokenizer_folder_and_nothing_beside_the_file(sources, tmp_path):
    """``tokenizer=`` a folder is used; files beside the GGUF file (a config, a generation
    config, a tokenizer, all wrong) are never read."""
    folder = tmp_path / "beside"
    folder.mkdir()
    file = G.write_gguf(sources["qwen3"], folder / "m.gguf")
    (folder / "config.json").write_text("{ not json")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "eos_token_id": 7}))
    (folder / "tokenizer.json").write_text("{ not json")
    words = tmp_path / "words"
    build_tokenizer(str(words))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning about them
        llm = make_llm(file, tokenizer=str(words))
    assert llm.get_tokenizer()("w5 w6")["input_ids"] == [5, 6]
    assert llm.get_default_sampling_params().temperature == 1.0
    assert llm.llm_engine.eos_token_ids == {2}
    out = llm.generate("w5 w6 w7", greedy(4), use_tqdm=False)[0]
    want = llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


# ----------------------------------------------------------------------------- the llama.cpp bench

def kld_file(path: Path, ids: list[int], logits: np.ndarray) -> Path:
    """A llama-perplexity --kl-divergence-base file of one chunk, written as llama.cpp writes it
    (the test plays llama.cpp with this engine's own logits)."""
    rows = logits[len(ids) // 2:len(ids) - 1].astype(np.float32)
    top = rows.max(1, keepdims=True)
    low = np.maximum(rows.min(1, keepdims=True), top - 16)
    lse = np.log(np.exp(rows - top).sum(1, keepdims=True))
    scale = (top - low) / 65535
    values = np.where(rows > low, np.rint((rows - low) / scale), 0).astype(np.uint16)
    header = np.concatenate([scale, low - top - lse], 1).astype(np.float32).view(np.uint16)
    pad = np.zeros((len(rows), values.shape[1] % 2), np.uint16)
    body = np.concatenate([header, values, pad], 1)
    head = np.array([len(ids), logits.shape[1], 1], np.int32)
    path.write_bytes(b"_logits_" + head.tobytes() + np.asarray(ids, np.int32).tobytes() + body.tobytes())
    return path


def test_the_bench_reads_llama_cpps_log_probabilities(block_files, tmp_path):
    """read_kld decodes llama.cpp's 16-bit rows: this engine against its own logits so written
    differs only by that rounding (half a step of 16 / 65535 nats), tokens and top all the same
    (a chunk of 200 tokens: the tiny model's context is 512, llama.cpp's run 514)."""
    from benchmarks import gguf_compare as bench

    file = block_files["Q4_0", "qwen3"][0]
    ids = random_prompt(200, 3)
    ours = bench.our_logprobs(file, ids, torch.float32, False)
    full = teacher_forced_logits(model_backend(file), ids, "whole").numpy()
    tokens, theirs, kept = bench.read_kld(kld_file(tmp_path / "base.kld", ids, full))
    assert tokens == ids and theirs.shape == ours.shape == (99, 512)
    figures = bench.compare(ours, theirs, kept, ids)
    assert figures["max_kept"] <= 2e-4 and figures["max"] <= 2e-4 and figures["same_top"] == 1.0


def model_backend(file: Path):
    from core.backend import Backend
    from core.gguf import load_gguf

    return Backend(load_gguf(file, "float32", torch.device("cpu")))


def test_the_bench_without_llama_cpp_says_so(capsys):
    from benchmarks import gguf_compare as bench

    assert bench.main([]) == 0
    assert "no llama.cpp build given (--llama-cpp DIR): nothing is compared" in capsys.readouterr().out
