"""The model as vLLM's engine arguments shape it: ``hf_overrides`` and ``load_format``.

* ``hf_overrides``: a dict of Hugging Face config fields (a nested dict updates a sub-config or
  a dict field such as ``rope_parameters``), or a callable that takes the config and returns
  it, applied before the model is built -- vLLM's context-extension example sets rope scaling
  and ``max_position_embeddings`` so; its tests shrink ``num_hidden_layers``.
* ``trust_remote_code``: passed to every transformers call (False by default, so no code of
  the checkpoint runs and transformers never asks on stdin).
* ``load_format="dummy"``: random weights of the checkpoint's shapes, from its config.json
  alone (no weight file is read), seeded by the engine's seed -- what vLLM's own tests and
  benchmarks use.

Without either, this is ``model.load_model``; a GGUF file (``LLM("model.gguf")``) is
core/gguf.py's ``load_gguf``, which takes neither. With overrides and real weights, the checkpoint
loads as saved, and its tensors move, without a copy, into a model built from the overridden
config: a weight the new shape does not use (a dropped layer) is left out, and one it lacks
or whose shape changed is an error naming it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.gguf import is_gguf, load_gguf
from model import (MODEL_TYPES, CausalLM, ModelConfig, RotaryEmbedding, load_model, quantized,
                   read_hf_config, resolve_dtype)


def load_checkpoint(path: Path, dtype, device: torch.device, hf_overrides=None,
                    load_format: str = "auto", seed: int | None = 0,
                    trust_remote_code: bool = False, quantization: str | None = None) -> CausalLM:
    """The model of the checkpoint at ``path``, as the engine arguments ask (``quantization``:
    8-bit weights, quantized once the float weights are in). A GGUF file loads as it is."""
    if is_gguf(path):
        check_gguf_arguments(path, hf_overrides, load_format, quantization)
        return load_gguf(path, dtype, device)
    if Path(path).is_file():
        raise ValueError(f"model {str(path)!r} is a file but not a GGUF file (it does not start "
                         f"with GGUF's magic); a model is a checkpoint directory or a .gguf file")
    if "gguf" in (quantization, load_format):
        raise ValueError(f"{'quantization' if quantization == 'gguf' else 'load_format'}='gguf' "
                         f"reads a GGUF file, but model {str(path)!r} is a checkpoint directory")
    if hf_overrides is None and load_format != "dummy":
        return load_model(path, dtype, device, trust_remote_code, quantization)
    hf_config = overridden_config(path, hf_overrides, trust_remote_code)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    # Checked before the checkpoint's tensors load: an override can make a field impossible.
    overridden = " with hf_overrides" if hf_overrides is not None else ""
    cfg = ModelConfig.from_hf(hf_config, f"{Path(path) / 'config.json'}{overridden}")
    if load_format == "dummy":
        model = dummy_model(cfg, torch_dtype, device, seed)
    else:
        model = rebuild(load_model(path, dtype, device, trust_remote_code), cfg)
    return quantized(model, quantization)


def check_gguf_arguments(path, hf_overrides, load_format: str, quantization: str | None) -> None:
    """What a GGUF file cannot take: its config is its metadata, its tensors keep their types."""
    if hf_overrides is not None:
        raise ValueError(f"hf_overrides are not applied to a GGUF file ({path}): its config is "
                         f"the file's metadata")
    if load_format not in ("auto", "gguf"):
        raise ValueError(f"load_format={load_format!r} does not read a GGUF file ({path}); use "
                         f"'auto' or 'gguf'")
    if quantization not in (None, "gguf"):
        raise ValueError(f"quantization={quantization!r}: a GGUF file's tensors keep the types "
                         f"the file gives them ({path}); use None or 'gguf'")


def hf_config_of(cfg: ModelConfig):
    """transformers' config of the decoder ``cfg`` describes (a GGUF file has no config.json)."""
    from transformers import AutoConfig

    model_type = next(t for t, arch in MODEL_TYPES.items() if arch == cfg.architecture)
    return AutoConfig.for_model(
        model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters), tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=list(cfg.eos_token_ids) or None, architectures=[cfg.architecture])


def overridden_config(path: Path, hf_overrides, trust_remote_code: bool = False):
    """The checkpoint's Hugging Face config with ``hf_overrides`` applied."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} has no config.json")
    hf_config = read_hf_config(Path(path), trust_remote_code)
    if callable(hf_overrides):
        hf_config = hf_overrides(hf_config)
    elif hf_overrides:
        apply_dict_overrides(hf_config, hf_overrides)
    return hf_config


def apply_dict_overrides(target, overrides: dict) -> None:
    """Set each field; a dict given for a sub-config or a dict field updates it in place."""
    for name, value in overrides.items():
        current = getattr(target, name, None)
        if isinstance(value, dict) and isinstance(current, dict):
            current.update(value)
        elif isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_dict_overrides(current, value)
        else:
            setattr(target, name, value)


def dummy_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                seed: int | None) -> CausalLM:
    """Random weights: matrices ~ N(0, 0.02), norm weights 1 (a usable random model)."""
    generator = torch.Generator().manual_seed(0 if seed is None else seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.to(device=device, dtype=dtype).eval()


def rebuild(loaded: CausalLM, cfg: ModelConfig) -> CausalLM:
    """``loaded``'s tensors in a model built from ``cfg`` (assigned, not copied)."""
    # A tied checkpoint that stores its own lm_head loaded untied (model.py): it stays so.
    cfg.tie_word_embeddings = cfg.tie_word_embeddings and loaded.config.tie_word_embeddings
    with torch.device("meta"):
        model = CausalLM(cfg)
    try:
        missing, _unused = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"hf_overrides change a weight's shape: {exc}") from None
    if missing:
        raise ValueError(f"hf_overrides need weights the checkpoint lacks: {', '.join(missing[:8])}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # RoPE tables are buffers, not weights: built anew for the overridden positions and scaling.
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters,
                                 cfg.max_position_embeddings).to(loaded.device)
    return model.eval()
