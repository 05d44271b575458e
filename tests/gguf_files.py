"""Tiny GGUF files for the tests, written with the ``gguf`` package's GGUFWriter from a tiny
random Hugging Face checkpoint, as llama.cpp's converter would write them (never downloaded).

* metadata: the config under the architecture's keys (``llama.embedding_length``, ...);
* tensors under GGUF's names; llama's Q and K rows reordered as the converter reorders them
  (``permute``: within each head, the two rotary halves interleaved); no ``output.weight`` for
  a tied checkpoint;
* each tensor in the type ``types`` gives it: F32, F16, BF16 as floats, Q8_0 and Q4_0 quantized
  here (``quantize``: llama.cpp's reference rounding, in numpy, into its block bytes), or any
  other type name written as raw bytes of the right size (for the refusals);
* ``dequantized_checkpoint``: the Hugging Face checkpoint with every weight replaced by what the
  file's bytes hold (the ``gguf`` package's own dequantizer), the spec of a quantized file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

HF_TO_GGUF = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """``model.layers.1.mlp.up_proj.weight`` -> ``blk.1.ffn_up.weight``."""
    name = hf.removeprefix("model.")
    part, kind = name.rsplit(".", 1)
    if part.startswith("layers."):
        _, layer, rest = part.split(".", 2)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"
    return f"{HF_TO_GGUF[part]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """The converter's reordering of llama's Q / K rows: per head, halves -> interleaved pairs."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# ----------------------------------------------------------------------------- quantizers

def quantize(rows: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``[rows, columns]`` as GGUF ``kind`` block bytes ``[rows, bytes]`` (llama.cpp's
    quantize_row_q8_0_ref / quantize_row_q4_0_ref)."""
    blocks = rows.astype(np.float32).reshape(rows.shape[0], -1, 32)
    if kind == "Q8_0":
        d = np.abs(blocks).max(-1, keepdims=True) / 127
        inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        scaled = blocks * inverse
        values = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8).view(np.uint8)
    else:  # Q4_0: the block's largest magnitude, signed, maps to -8
        signed = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
        d = signed / -8
        inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.minimum(15, np.trunc(blocks * inverse + 8.5)).astype(np.uint8)
        values = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j low, element j + 16 high
    scale = d.astype(np.float16).view(np.uint8)  # [rows, blocks, 2]
    return np.concatenate([scale, values], axis=-1).reshape(rows.shape[0], -1)


def as_type(array: np.ndarray, kind: str):
    """(the array to write, its GGUF type) for a float32 tensor written as ``kind``."""
    from gguf import GGMLQuantizationType as T

    if kind == "F32":
        return array.astype(np.float32), None
    if kind == "F16":
        return array.astype(np.float16), None
    if kind == "BF16":
        bits = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).bfloat16()
        return bits.view(torch.int16).numpy().view(np.uint8), T.BF16
    if kind in ("Q8_0", "Q4_0"):  # a vector as one row
        return quantize(array.reshape(-1, array.shape[-1]), kind).reshape(*array.shape[:-1], -1), T[kind]
    from gguf import GGML_QUANT_SIZES  # any other type: bytes of the right size (never read)
    block, size = GGML_QUANT_SIZES[T[kind]]
    return np.zeros((array.shape[0], array.shape[-1] // block * size), np.uint8), T[kind]


# ----------------------------------------------------------------------------- files

Types = Callable[[str, np.ndarray], str]  # (GGUF name, tensor) -> its type


def all_in(kind: str) -> Types:
    """Matrices in ``kind``, vectors (norms, biases) in F32, as llama.cpp writes them."""
    return lambda name, array: kind if array.ndim == 2 else "F32"


def write_gguf(source: str, out: Path, types: Types = all_in("F32"), skip=(), extra=None,
               arch: str | None = None, tokenizer: dict | None = None) -> Path:
    """``source``'s checkpoint as a GGUF file at ``out``; ``skip``: GGUF names left out,
    ``extra``: more tensors by GGUF name, ``tokenizer``: tokenizer.ggml.* metadata."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    cfg = model.config
    writer = gguf.GGUFWriter(str(out), arch or cfg.model_type)
    _write_config(writer, cfg, bool(tokenizer))
    if tokenizer:
        _write_tokenizer(writer, tokenizer)
    for name, array in converted_tensors(model).items():
        if name not in skip:
            data, raw = as_type(array, types(name, array))
            writer.add_tensor(name, data, raw_dtype=raw)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def converted_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as the converter gives them (llama's Q/K reordered, a tied
    head left out)."""
    cfg = model.config
    out = {}
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if cfg.model_type == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads
            array = permute(array, heads)
        out[gguf_name(hf)] = array
    return out


def _write_config(writer, cfg, has_tokenizer: bool) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _write_rope_scaling(writer, cfg.rope_parameters)
    writer.add_vocab_size(cfg.vocab_size)
    if not has_tokenizer:
        writer.add_eos_token_id(cfg.eos_token_id)


def _write_rope_scaling(writer, rope: dict) -> None:
    """Linear and YaRN scaling as the converter writes them (llama 3's is a tensor instead)."""
    from gguf import RopeScalingType

    kind = rope.get("rope_type", "default")
    if kind == "default":
        return
    writer.add_rope_scaling_type(RopeScalingType(kind))
    writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _write_tokenizer(writer, tok: dict) -> None:
    writer.add_tokenizer_model(tok["model"])
    writer.add_tokenizer_pre(tok.get("pre", "default"))
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    if "merges" in tok:
        writer.add_token_merges(tok["merges"])
    if "scores" in tok:
        writer.add_token_scores(tok["scores"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])


def dequantized_checkpoint(source: str, gguf_file: Path, out: Path) -> str:
    """``source`` with every weight replaced by what ``gguf_file`` holds for it (dequantized
    by the gguf package, llama's Q/K rows put back): the spec of a quantized file."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    cfg = model.config
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}
    with torch.no_grad():
        for hf, param in model.state_dict().items():
            if hf == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            t = tensors[gguf_name(hf)]
            array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(param.shape)
            if cfg.model_type == "llama" and (".q_proj." in hf or ".k_proj." in hf):
                heads = cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads
                array = unpermute(array, heads)
            param.copy_(torch.from_numpy(np.array(array, dtype=np.float32)))
    model.save_pretrained(str(out))
    return str(out)


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
