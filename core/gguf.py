"""GGUF files (llama.cpp's format) loaded as they are: ``LLM("model.gguf", tokenizer=...)``.

One file holds the config (as metadata: ``llama.embedding_length``, ...) and every tensor, each
in its own type. This file reads it with the ``gguf`` package and builds model.py's decoder:

* the architecture (``general.architecture``): llama, qwen2 or qwen3; anything else is refused
  naming it. The config comes from the metadata alone (``model_config``): a tied LM head when
  the file has no ``output.weight`` (llama.cpp then reads ``token_embd``), biases where the
  file has them (qwen2's q/k/v), qwen3's q/k norms;
* each tensor's GGUF name maps to the Hugging Face name (``hf_name``), so model.py's loader
  puts it in place (q/k/v and gate/up into their fused parameters) and checks it;
* each tensor's type decides how its part stores its weight (``part_formats``): F32, F16 and
  BF16 into the float model, cast to its dtype as transformers does; Q8_0 into the ``"q8_0"``
  format and Q4_0 into ``"int4"`` (core/q8_0_format.py, core/int4_format.py), whose layouts
  are GGUF's own: a block's bytes are split into its float16 scale and its values by a reshape
  and a view, never widened to floats in memory. Any other type (Q4_K, Q6_K, ...) is refused
  naming the type and the tensor. A file may mix types, each part gets its own tensor's;
* llama: llama.cpp's converter reorders the rows of Q and K (each head's two halves of the
  rotary dimensions interleaved, the layout its RoPE reads); ``unpermute`` puts them back, so
  the model computes exactly what Hugging Face computes on the original checkpoint. qwen2 and
  qwen3 are converted without that reordering.

GGUF lists a tensor's dimensions innermost first: a ``[rows, columns]`` weight has ``shape``
``(columns, rows)``; the reader's ``data`` is already outermost first (bytes per row for block
types). Nothing but the file is read.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from core.formats import FORMATS
from core.q8_0_format import BLOCK
from core.weight_format import WeightFormat
from model import MODEL_TYPES, CausalLM, ModelConfig, check_config, empty_model, fused_name, resolve_dtype

ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_FORMATS = {"Q8_0": "q8_0", "Q4_0": "int4"}  # GGUF block type -> the format storing it as is
BLOCK_SCALE_BYTES = 2  # every block starts with its float16 scale

GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def is_gguf(path) -> bool:
    """A file (not a checkpoint directory) that starts with GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def load_gguf(path, dtype, device: torch.device) -> CausalLM:
    """The model of the GGUF file at ``path``; ``dtype`` "auto" (or None) is float32, the dtype
    transformers loads a GGUF file in."""
    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = model_config(reader, tensors, path)
    torch_dtype = torch.float32 if dtype in (None, "auto") else resolve_dtype(dtype, None, device)
    check_names(tensors, cfg, path)
    model = empty_model(cfg, torch_dtype, device, part_formats(tensors, path))
    for name, tensor in tensors.items():
        _load_tensor(model, name, tensor, path)
    model.quantization = "gguf"
    return model.eval()


def open_reader(path):
    """The file's reader; a file that is not GGUF, or damaged or cut short, refused naming it."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path, mode="c")  # copy-on-write: tensors are views of the file
    except (ValueError, IndexError, OSError) as err:
        raise ValueError(f"cannot read GGUF file {path}: {err} (the file is damaged or cut "
                         f"short)") from None


# ----------------------------------------------------------------------------- the config

def metadata(reader, key: str, path, default=...):
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"GGUF file {path} has no metadata {key!r}; the model is not built")
        return default
    return field.contents()


def model_config(reader, tensors: dict, path) -> ModelConfig:
    """model.py's config from the metadata (and which tensors exist: tying, biases)."""
    arch = metadata(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {path}: architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")

    def m(key, default=...):
        return metadata(reader, f"{arch}.{key}", path, default)

    heads = m("attention.head_count")
    hf = dict(vocab_size=m("vocab_size", None) or _rows(tensors.get("token_embd.weight")),
              hidden_size=m("embedding_length"), intermediate_size=m("feed_forward_length"),
              num_hidden_layers=m("block_count"), num_attention_heads=heads,
              num_key_value_heads=m("attention.head_count_kv", heads),
              head_dim=m("attention.key_length", None), max_position_embeddings=m("context_length"),
              rms_norm_eps=m("attention.layer_norm_rms_epsilon"), rope_theta=m("rope.freq_base", 10000.0))
    check_config(hf, f"GGUF file {path} (metadata under {arch}.)")
    head_dim = hf["head_dim"] or hf["hidden_size"] // heads
    _check_rotary(m("rope.dimension_count", head_dim), head_dim, m("attention.value_length", head_dim),
                  tensors, path)
    eos = metadata(reader, "tokenizer.ggml.eos_token_id", path, None)
    return ModelConfig(
        architecture=MODEL_TYPES[arch], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf["num_key_value_heads"], head_dim=head_dim,
        rms_norm_eps=hf["rms_norm_eps"], max_position_embeddings=hf["max_position_embeddings"],
        rope_parameters=_rope_parameters(m, hf["rope_theta"], path),
        qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors, qk_norm=arch == "qwen3",
        tie_word_embeddings="output.weight" not in tensors,
        layer_windows=(None,) * hf["num_hidden_layers"],  # HF's three attend fully by default
        eos_token_ids=() if eos is None else (int(eos),))


def _rows(tensor) -> int | None:
    return None if tensor is None else int(tensor.shape[-1])  # dims innermost first


def _check_rotary(rope_dims: int, head_dim: int, value_dim: int, tensors: dict, path) -> None:
    """What this decoder cannot run, refused by name: partial rotary, V heads of another
    size, and llama 3's frequency factors (a ``rope_freqs.weight`` tensor)."""
    if rope_dims != head_dim or value_dim != head_dim:
        raise ValueError(f"GGUF file {path}: rotary dimensions {rope_dims} and value length "
                         f"{value_dim} must both be the head size {head_dim} here")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"GGUF file {path} holds rope_freqs.weight (llama 3's rope scaling as "
                         f"frequency factors), which this engine does not read")


def _rope_parameters(m, theta: float, path) -> dict:
    """rope_parameters as model.py reads them: none, linear or YaRN scaling."""
    kind = m("rope.scaling.type", "none")
    params = {"rope_type": "default", "rope_theta": float(theta)}
    if kind == "none":
        return params
    if kind == "linear":
        return {**params, "rope_type": "linear", "factor": float(m("rope.scaling.factor"))}
    if kind == "yarn":  # beta_fast / beta_slow where the file says them, else YaRN's 32 / 1
        return {**params, "rope_type": "yarn", "factor": float(m("rope.scaling.factor")),
                "original_max_position_embeddings": m("rope.scaling.original_context_length"),
                "beta_fast": m("rope.scaling.yarn_beta_fast", None),
                "beta_slow": m("rope.scaling.yarn_beta_slow", None)}
    raise ValueError(f"GGUF file {path}: rope scaling {kind!r} is not supported (none, linear, yarn)")


# ----------------------------------------------------------------------------- names and types

def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: no model here reads it)."""
    found = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", gguf_name)
    if found is None:
        return None
    layer, part, kind = found.groups()
    names = GLOBAL_NAMES if layer is None else LAYER_NAMES
    if part not in names:
        return None
    prefix = "" if layer is None else f"layers.{layer}."
    return f"{prefix}{names[part]}.{kind}"


def type_name(tensor) -> str:
    return tensor.tensor_type.name


def part_formats(tensors: dict, path) -> dict[str, WeightFormat]:
    """The weight format of each part whose tensors are GGUF blocks (part name -> format);
    a type this engine does not load is refused, naming the type and the tensor."""
    types: dict[str, dict[str, str]] = {}  # part -> its tensors' types, by GGUF name
    for name, tensor in tensors.items():
        kind = type_name(tensor)
        if kind not in FLOAT_TYPES and kind not in BLOCK_FORMATS:
            raise ValueError(f"GGUF file {path}: tensor {name} is {kind}; this engine loads "
                             f"{', '.join(FLOAT_TYPES + tuple(BLOCK_FORMATS))} tensors only")
        if kind in BLOCK_FORMATS and len(tensor.shape) != 2:
            raise ValueError(f"GGUF file {path}: tensor {name} is {kind} but not a matrix; "
                             f"blocks are loaded for matrices only")
        hf = hf_name(name)
        if hf.endswith(".weight"):
            part = fused_name(hf)[0].removesuffix(".weight")
            types.setdefault(part, {})[name] = kind
    return {part: _one_format(part, kinds, path) for part, kinds in types.items()
            if any(k in BLOCK_FORMATS for k in kinds.values())}


def _one_format(part: str, kinds: dict[str, str], path) -> WeightFormat:
    """A fused part (q/k/v, gate/up) is one weight: its tensors must share one block type."""
    if len(set(kinds.values())) > 1:
        listed = ", ".join(f"{name} {kind}" for name, kind in kinds.items())
        raise ValueError(f"GGUF file {path}: {listed} are one fused weight here ({part}) and "
                         f"must have one type")
    return FORMATS[BLOCK_FORMATS[next(iter(kinds.values()))]]


def check_names(tensors: dict, cfg: ModelConfig, path) -> None:
    """Every tensor the config needs is in the file, and the file holds no other (a name no
    decoder here has, a layer past block_count, a bias the first layer lacks)."""
    expected = expected_names(cfg)
    unused = [name for name in tensors if name not in set(expected)]
    if unused:
        raise ValueError(f"GGUF file {path} holds tensors no {cfg.architecture} here reads: "
                         f"{', '.join(unused[:5])}")
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"GGUF file {path} lacks tensors: {', '.join(missing[:8])}")


def expected_names(cfg: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    names += [] if cfg.tie_word_embeddings else ["output.weight"]
    per_layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_gate", "ffn_up", "ffn_down"] + (["attn_q_norm", "attn_k_norm"] if cfg.qk_norm else [])
    biases = (["attn_q", "attn_k", "attn_v"] if cfg.qkv_bias else []) + (
        ["attn_output"] if cfg.o_bias else []) + (["ffn_gate", "ffn_up", "ffn_down"] if cfg.mlp_bias else [])
    return names + [f"blk.{i}.{n}.{kind}" for i in range(cfg.num_layers)
                    for kind, parts in (("weight", per_layer), ("bias", biases)) for n in parts]


# ----------------------------------------------------------------------------- the tensors

def _load_tensor(model: CausalLM, name: str, tensor, path) -> None:
    """One GGUF tensor into its part, as stored; an error names the tensor and the file."""
    hf = hf_name(name)
    stored = as_stored(tensor, model.get_submodule(fused_name(hf)[0].rpartition(".")[0]), hf)
    if model.config.architecture == "LlamaForCausalLM" and (".q_proj." in hf or ".k_proj." in hf):
        heads = model.config.num_heads if ".q_proj." in hf else model.config.num_kv_heads
        stored = {key: unpermute(value, heads) for key, value in stored.items()}
    try:
        model.load_weights(stored.items())
    except ValueError as err:
        raise ValueError(f"GGUF file {path}, tensor {name} ({type_name(tensor)}): {err}") from None


def as_stored(tensor, part, hf: str) -> dict[str, torch.Tensor]:
    """The tensor as its part stores it, by Hugging Face name: a float tensor as it is (model.py
    casts it to the model's dtype); a block tensor split into its values (``weight``, viewed
    as the part's stored dtype) and scales (``weight_scale``, float16) without arithmetic."""
    data = torch.from_numpy(tensor.data)
    kind = type_name(tensor)
    if kind == "BF16":  # the reader gives BF16 as bytes: two a value
        return {hf: data.view(torch.bfloat16)}
    if kind not in BLOCK_FORMATS:
        return {hf: data}
    columns = int(tensor.shape[0])
    blocks = data.unflatten(-1, (columns // BLOCK, -1))  # [rows, blocks, bytes of a block]
    scale = blocks[..., :BLOCK_SCALE_BYTES].view(torch.float16).squeeze(-1)
    values = blocks[..., BLOCK_SCALE_BYTES:].view(part.weight.dtype).flatten(1)
    return {hf: values, f"{hf}_scale": scale}


def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows (or bias, or a block tensor's rows) from llama.cpp's order back to Hugging
    Face's: within each head, GGUF row 2i + h is HF row h * head_dim / 2 + i (h: which half)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
