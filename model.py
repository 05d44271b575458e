"""The decoder of step14_5, run on the paged KV pool: Llama, Qwen2, Qwen3 and Mistral.

One forward takes a packed batch: the prefill chunks and decode tokens of many sequences,
back to back (``SeqChunk``). An attention backend plans the step once: ``AttentionMetadata``
below is the plain one (positions, the slot each new token's K/V goes to, each sequence's
block table). Each layer writes the new tokens' K/V into their slots of the pool, and the
plan attends: here, gather each sequence's blocks back and one SDPA call over them.
``paged_attention`` is the whole of it, and the spec.

A faster backend (fast/, chosen by the engine's builder, never by this file) plans its own
attention and may compute the parts this file declares replaceable (the backend seam: linears,
norms, MLPs, each head's norm + RoPE, whole decoder layers) its own way, on this model's own parameters; it is tested
equal to this path.

Reading order: config -> RoPE -> the backend seam -> norm -> paged attention -> MLP -> layer ->
model -> loading -> weight formats (8-bit weights; what each format does is core/weight_format.py).
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core import formats
from core.formats import QUANTIZATIONS, check_quantization  # noqa: F401  (QUANTIZATIONS: for callers)
from core.weight_format import ALL_ROWS, UNQUANTIZED, WeightFormat

# config.json's model_type -> the decoder it names, as Hugging Face picks the class (by
# model_type, whatever "architectures" says).
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES.values())


# ----------------------------------------------------------------------------- config

@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    layer_windows: tuple[int | None, ...] = ()  # sliding window per layer, None = full
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf, source: str = "config.json") -> "ModelConfig":
        """The decoder ``model_type`` names, with its biases and windows as HF builds them;
        an impossible field is refused naming it and ``source`` (where the config came from)."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in MODEL_TYPES:
            arch = (getattr(hf, "architectures", None) or [None])[0]
            raise ValueError(f"unsupported architecture {arch!r}: config.json's model_type "
                             f"{model_type!r} is none of {', '.join(MODEL_TYPES)} (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        check_config(hf.to_dict(), source)  # transformers' defaults and any hf_overrides included
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        return cls(
            architecture=MODEL_TYPES[model_type], vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            rope_parameters=_rope_parameters(hf), hidden_act=hf.hidden_act,
            **_biases(model_type, hf), qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            layer_windows=_layer_windows(hf, model_type), eos_token_ids=_as_tuple(hf.eos_token_id))


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_COUNT = "an integer >= 1"
# Each field a decoder is built from, and what it must be: (field, what, test of its value ``v``
# given the whole config ``c``), checked in order, so a row may rely on the rows above it. An
# absent field is not checked (transformers fills its default). transformers 5 checks the types
# but hardly a value (a Llama with 0 heads fails there with a ZeroDivisionError, naming nothing).
CONFIG_RULES: tuple[tuple[str, str, Callable], ...] = (
    ("vocab_size", _COUNT, lambda v, c: _is_count(v)),
    ("hidden_size", _COUNT, lambda v, c: _is_count(v)),
    ("intermediate_size", _COUNT, lambda v, c: _is_count(v)),
    ("num_hidden_layers", _COUNT, lambda v, c: _is_count(v)),
    ("num_attention_heads", _COUNT, lambda v, c: _is_count(v)),
    ("num_key_value_heads", "an integer >= 1 that divides num_attention_heads "
     "({num_attention_heads}), or null", lambda v, c: v is None or _is_count(v) and
     c.get("num_attention_heads", v) % v == 0),
    ("head_dim", f"{_COUNT}, or null", lambda v, c: v is None or _is_count(v)),
    ("hidden_size", "a multiple of num_attention_heads ({num_attention_heads}) when head_dim "
     "is not given", lambda v, c: c.get("head_dim") is not None or
     v % c.get("num_attention_heads", 1) == 0),
    ("max_position_embeddings", _COUNT, lambda v, c: _is_count(v)),
    # a float, as transformers 5 requires; an eps <= 0, NaN or inf can make every norm NaN
    ("rms_norm_eps", "a finite float > 0", lambda v, c: isinstance(v, float) and 0 < v < math.inf),
    ("rope_theta", "a finite number > 0, or null", lambda v, c: v is None or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf)),
)


def check_config(config: Mapping, source: str) -> None:
    """Refuse the first impossible field (``CONFIG_RULES``) of ``config`` (config.json's
    fields, or a transformers config's ``to_dict()``), naming it and ``source``."""
    fields = dict(config)
    rope = fields.get("rope_parameters")
    if isinstance(rope, Mapping) and "rope_theta" in rope:  # where transformers 5 keeps it
        fields["rope_theta"] = rope["rope_theta"]
    for field, what, valid in CONFIG_RULES:
        if field in fields and not valid(fields[field], fields):
            raise ValueError(f"checkpoint config {source}: {field} is {fields[field]!r}, but it "
                             f"must be {what.format_map(fields)}; the model is not built")


def _biases(model_type: str, hf) -> dict:
    """Which projections carry a bias, per decoder (as each HF class builds its layers)."""
    attention_bias = bool(getattr(hf, "attention_bias", False))
    if model_type == "qwen2":
        return dict(qkv_bias=True, o_bias=False, mlp_bias=False)
    if model_type == "mistral":
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False)
    mlp_bias = model_type == "llama" and bool(getattr(hf, "mlp_bias", False))
    return dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=mlp_bias)


def _as_tuple(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def _rope_parameters(hf) -> dict:
    """transformers 5 keeps rope settings in ``rope_parameters``; 4.x in rope_theta/rope_scaling."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf, "rope_theta", None) or 10000.0
    scaling = getattr(hf, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _layer_windows(hf, model_type: str) -> tuple[int | None, ...]:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if model_type == "llama":  # HF's Llama attends fully whatever the config carries
        return (None,) * n
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(hf, "use_sliding_window", None) is False:
        return (None,) * n
    return (window,) * n


# ----------------------------------------------------------------------------- RoPE

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for the checkpoint's RoPE type."""
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_position), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, params, max_position), _yarn_attention_factor(params, max_position)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_position: int) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params.get("original_max_position_embeddings") or max_position)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_factor(params: dict, max_position: int) -> float:
    """YaRN's context factor; without one, the ratio of the context to the pretraining one."""
    original = params.get("original_max_position_embeddings") or max_position
    return float(params.get("factor") or max_position / original)


def _yarn_attention_factor(params: dict, max_position: int) -> float:
    """The cos/sin scale: ``attention_factor`` if given, else YaRN's mscale of the factor
    (the ratio of two mscales where ``mscale`` and ``mscale_all_dim`` are both set)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position)

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(params["mscale"]) / mscale(params["mscale_all_dim"]))
    return mscale()


def _yarn_inv_freq(head_dim: int, params: dict, max_position: int) -> torch.Tensor:
    """YaRN: the low-frequency dimensions interpolated (divided by the factor), the
    high-frequency ones kept, a linear ramp between, in the order HF computes it."""
    base = float(params["rope_theta"])
    factor = _yarn_factor(params, max_position)
    original = params.get("original_max_position_embeddings") or max_position
    low, high = _yarn_ramp_ends(params, head_dim, base, original)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _yarn_ramp_ends(params: dict, dim: int, base: float, original: int) -> tuple[float, float]:
    """The dimensions where ``beta_fast`` and ``beta_slow`` rotations fit the pretraining
    context (rounded outwards unless ``truncate`` is false)."""
    def dimension(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dimension(params.get("beta_fast") or 32)
    high = dimension(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position, indexed per token (positions differ per sequence)."""

    def __init__(self, head_dim: int, params: dict, max_position: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(head_dim, params, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos (for both halves) and sin per token, looked up once per forward for all layers."""
        cos = self.cos[positions].to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; HF's rotate-half, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
    as one product and two in-place updates instead of seven ops and a concatenation."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin, value=-1)
    out[..., half:].addcmul_(x[..., :half], sin)
    return out


# ----------------------------------------------------------------------------- the backend seam
#
# What a backend (core/backend.py) may compute its own way, and nothing else: the parts that
# derive from ``Replaceable`` -- every linear layer (``Linear``), every norm (``RMSNorm``), each
# MLP (``MLP``), each attention's head norm + RoPE (``HeadRotation``) and each decoder layer
# (``DecoderLayer``: its replacement must honour its parts' hooks and replacements, or leave the
# step to them) -- besides the attention itself, which the backend plans (``AttentionBackend`` below). ``CausalLM.install`` gives parts
# a replacement; a part's forward then returns ``replacement(part, *inputs)`` instead of its own
# ``compute(*inputs)``. The part stays the user's module: a replacement reads its parameters on
# every call (whatever it derives from them, it keeps in step with their version counters), its
# forward hooks fire, and a subclass that overrides ``compute`` or ``forward`` is never replaced.

DECLARED: dict[str, type] = {}  # kind -> the class of this file that declares it


class Replaceable(nn.Module):
    kind = ""           # "linear", "norm", "mlp", "rotation" or "layer": what a replacement computes
    replacement = None  # a backend's callable (part, *inputs) -> output; None: ``compute``

    def __init_subclass__(cls, kind: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind, DECLARED[kind] = kind, cls

    def forward(self, *inputs):
        replacement = self.replacement
        return self.compute(*inputs) if replacement is None else replacement(self, *inputs)

    def compute(self, *inputs):
        raise NotImplementedError

    def computes_as_declared(self) -> bool:
        """False for a subclass with its own math: a backend leaves it alone."""
        declared = DECLARED[self.kind]
        return type(self).compute is declared.compute and type(self).forward is Replaceable.forward


class Linear(Replaceable, nn.Linear, kind="linear"):
    """nn.Linear (same parameters and names) as a replaceable part."""

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------- norm

class RMSNorm(Replaceable, kind="norm"):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        # As HF's LlamaRMSNorm: normalise in float32, cast to the input dtype, then multiply by
        # the weight in that dtype -- bit-identical to HF in bfloat16 / float16 (F.rms_norm with
        # the weight multiplies before it casts, which differs by one rounding on ~1/4 of them).
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


# ----------------------------------------------------------------------------- paged attention

@dataclass
class SeqChunk:
    """What one sequence contributes to a forward: positions [start, start + length) of the
    sequence whose blocks, in order, are ``block_table``."""

    start: int
    length: int
    block_table: list[int]


class AttentionPlan(Protocol):
    """One step's attention, planned once (``AttentionBackend.plan``) and run in every layer."""

    positions: torch.Tensor      # [T] absolute position of each packed token
    slot_mapping: torch.Tensor   # [T] pool slot that receives each packed token's K/V

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor,
               pool_v: torch.Tensor, window: int | None) -> torch.Tensor:
        """q [T, H, D], this step's k, v [T, KVH, D] (already in the pool) -> [T, H, D]."""


class AttentionBackend(Protocol):
    def plan(self, chunks: list[SeqChunk], block_size: int) -> AttentionPlan: ...


def token_slots(chunks: list[SeqChunk], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[T] position of each packed token, [T] the pool slot its K/V goes to, [B] each chunk's
    first packed token: what every backend's plan starts from."""
    lengths = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    first = np.cumsum(lengths) - lengths
    seq = np.repeat(np.arange(len(chunks)), lengths)
    positions = np.arange(lengths.sum()) - first[seq] + starts[seq]
    block_ids = _table_entries(chunks, seq, positions // block_size)
    return positions, block_ids * block_size + positions % block_size, first


def _table_entries(chunks: list[SeqChunk], seq: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``chunks[seq[i]].block_table[index[i]]`` for every i, without a [B, blocks] table."""
    tables = np.concatenate([np.asarray(c.block_table, dtype=np.int64) for c in chunks])
    offsets = np.cumsum([0] + [len(c.block_table) for c in chunks[:-1]])
    return tables[offsets[seq] + index]


@dataclass
class AttentionMetadata:
    """The plain backend's plan of one packed batch, built once per step (``build``).

    B sequences contribute chunks of up to Lq tokens; the packed batch holds them back to back.
    For the padded [B, Lq] query grid, padding repeats a sequence's last token (finite output,
    then dropped by ``is_query``)."""

    positions: torch.Tensor        # [T] absolute position of each packed token
    slot_mapping: torch.Tensor     # [T] pool slot that receives each packed token's K/V
    block_tables: torch.Tensor     # [B, blocks] each sequence's blocks in order, zero-padded
    query_index: torch.Tensor      # [B, Lq] packed token in each query slot
    query_positions: torch.Tensor  # [B, Lq] its absolute position
    is_query: torch.Tensor         # [B, Lq] bool: a real token, not padding
    block_size: int

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, device: torch.device) -> AttentionMetadata:
        positions, slots, first = token_slots(chunks, block_size)
        lengths = np.array([c.length for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        tables = block_tables(chunks, starts + lengths, block_size)
        step = np.arange(lengths.max())[None, :]
        offset = np.minimum(step, lengths[:, None] - 1)  # padding repeats the last token
        arrays = (positions, slots, tables, first[:, None] + offset, starts[:, None] + offset,
                  step < lengths[:, None])
        return cls(*(torch.from_numpy(a).to(device) for a in arrays), block_size)

    def attend(self, q, k, v, pool_k, pool_v, window: int | None) -> torch.Tensor:
        return paged_attention(q, pool_k, pool_v, self, window)


class PagedAttention:
    """The plain attention backend: ``AttentionMetadata`` plans, ``paged_attention`` attends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, chunks: list[SeqChunk], block_size: int) -> AttentionMetadata:
        return AttentionMetadata.build(chunks, block_size, self.device)


def block_tables(chunks: list[SeqChunk], context_lengths: np.ndarray, block_size: int) -> np.ndarray:
    """[B, blocks]: the blocks holding each sequence's context so far, zero-padded (padding
    lies past the context, so the causal mask hides it)."""
    needed = -(-context_lengths // block_size)
    tables = np.zeros((len(chunks), int(needed.max())), dtype=np.int64)
    for row, (chunk, n) in enumerate(zip(chunks, needed)):
        tables[row, :n] = chunk.block_table[:n]
    return tables


def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, KVH, D]) in their slots of one layer's pool
    ([KVH, num_blocks * block_size, D], head-major: see KVCachePool)."""
    pool_k.index_copy_(1, slots, k.transpose(0, 1))
    pool_v.index_copy_(1, slots, v.transpose(0, 1))


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, KVH, blocks * block_size, D]: each sequence's blocks read back in table order, so
    key j of a row is the token at position j of that sequence."""
    heads, _, dim = pool.shape
    blocks = pool.view(heads, -1, block_size, dim)[:, tables]  # [KVH, B, blocks, block_size, D]
    return blocks.flatten(2, 3).transpose(0, 1)


def paged_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                    meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D]. Every query attends over its sequence's context in the pool
    (its own new K/V already written there): causal by absolute position, limited to the
    last ``window`` positions where the layer has a sliding window. Grouped-query heads pair
    query head h with KV head h // (H / KVH), as HF's repeat_kv does."""
    queries = q[meta.query_index].transpose(1, 2)  # [B, H, Lq, D]
    keys = gather_blocks(pool_k, meta.block_tables, meta.block_size)
    values = gather_blocks(pool_v, meta.block_tables, meta.block_size)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    query_pos = meta.query_positions[..., None]
    visible = key_pos <= query_pos  # [B, Lq, keys]
    if window is not None:
        visible &= key_pos > query_pos - window
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible[:, None],
                                         enable_gqa=True)
    return out.transpose(1, 2)[meta.is_query]  # chunks are packed in order: no scatter


class HeadRotation(Replaceable, kind="rotation"):
    """Each head's norm (Qwen3's q_norm / k_norm; None: none) and RoPE, as a replaceable part."""

    def compute(self, x: torch.Tensor, norm: RMSNorm | None, rope) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        return apply_rope(x if norm is None else norm(x), *rope)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.window = cfg.layer_windows[layer]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotation = HeadRotation()  # no parameters: the checkpoint's names are unchanged

    def forward(self, x, plan: AttentionPlan, pool_k, pool_v, rope):
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.rotation(q.view(-1, self.num_heads, self.head_dim), self.q_norm, rope)
        k = self.rotation(k.view(-1, self.num_kv_heads, self.head_dim), self.k_norm, rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        write_kv(pool_k, pool_v, plan.slot_mapping, k, v)
        out = plan.attend(q, k, v, pool_k, pool_v, self.window)
        return self.o_proj(out.flatten(1))


# ----------------------------------------------------------------------------- MLP, layer, model

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(Replaceable, kind="mlp"):
    """down(act(gate(x)) * up(x)), with gate and up as one [2 x intermediate, hidden] weight."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        self.hidden_act = cfg.hidden_act
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # act() returns a fresh tensor: multiply in place, no second activation-sized buffer.
        return self.down_proj(ACTIVATIONS[self.hidden_act](gate).mul_(up))


class DecoderLayer(Replaceable, kind="layer"):
    """Attention and MLP, each around a norm and a residual add; replaceable as a whole (a
    backend may run a decode step's layer in one call of its own: fast/decode_layer.py)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def compute(self, x, plan: AttentionPlan, pool_k, pool_v, rope):
        x = x + self.self_attn(self.input_layernorm(x), plan, pool_k, pool_v, rope)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> norm -> lm_head, for the rows that need logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.quantization: str | None = None  # the weight format's name, set by ``quantized``

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'; a quantized model's weights are in its format)."""
        return self.norm.weight.dtype

    def replaceable_parts(self) -> Iterator[tuple[str, Replaceable]]:
        """(name, part) of every part a backend may replace (the seam above)."""
        return ((name, m) for name, m in self.named_modules()
                if isinstance(m, Replaceable) and m.computes_as_declared())

    def install(self, replacements: Mapping[str, Callable]) -> None:
        """Each replaceable part computes by ``replacements[its name]``, or by itself where
        none is named (``{}``: model.py's own math everywhere)."""
        for name, part in self.replaceable_parts():
            part.replacement = replacements.get(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's model method: checkpoint-named tensors (HF / vLLM names, q/k/v and gate/up
        into their fused parameters) loaded in place, each by its part's weight format (a
        quantized part quantizes a float weight); returns the parameters filled. All are
        checked first (a name no parameter takes, a wrong shape, NaN / inf), so a refused
        batch changes nothing. In place under ``no_grad``: version counters move, so the
        engine sees the change before its next step."""
        targets = [_weight_target(self, name, tensor, "load_weights")
                   for name, tensor in weights if not self._skips_weight(name)]
        with torch.no_grad():
            for target in targets:
                target.load()
        return {target.param_name for target in targets}

    def _skips_weight(self, name: str) -> bool:
        """Rotary tables (recomputed) and, as vLLM, a tied model's lm_head (the embedding's)."""
        tied_head = self.config.tie_word_embeddings and name.removeprefix("model.") == "lm_head.weight"
        return name.endswith(_IGNORED_SUFFIXES) or tied_head

    @torch.inference_mode()
    def forward(self, input_ids, plan: AttentionPlan, kv, logits_index) -> torch.Tensor:
        """Float32 logits of the packed tokens at ``logits_index``; ``kv`` is the engine's
        KVCachePool (block_manager.py), one [KVH, slots, D] K and V pool per layer."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.lookup(plan.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, plan, kv.k[i], kv.v[i], rope)
        return self.lm_head(self.norm(x[logits_index])).float()


# ----------------------------------------------------------------------------- loading

def load_model(path: str | Path, dtype: str | torch.dtype | None, device: torch.device,
               trust_remote_code: bool = False, quantization: str | None = None) -> CausalLM:
    """Build the model from a local Hugging Face checkpoint directory; ``quantization`` (a
    registered weight format, e.g. "int8") quantizes its float weights once they are in
    (weight formats, below)."""
    check_quantization(quantization)

    path = _checkpoint_dir(path)
    hf_config = read_hf_config(path, trust_remote_code)
    cfg = ModelConfig.from_hf(hf_config, str(path / "config.json"))
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    model = empty_model(cfg, torch_dtype, device)
    _load_weights(model, path, torch_dtype)
    return quantized(model, quantization)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                part_formats: Mapping[str, WeightFormat] | None = None) -> CausalLM:
    """The model of ``cfg`` on ``device``, its weights uninitialised, to be loaded.
    ``part_formats``: parts (a linear's name, or ``embed_tokens``) that keep their weight in that
    format, each created empty in it -- no float weight is ever allocated for them (a file whose
    tensors are already in a format, e.g. GGUF blocks, is copied into them as stored)."""
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
        for name, weight_format in (part_formats or {}).items():
            _empty_in_format(model, name, weight_format)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty() materialises shared parameters separately
        embedding = model.embed_tokens
        if hasattr(embedding, "tied_head"):
            model.lm_head = embedding.tied_head()
        else:
            model.lm_head.weight = embedding.weight
    # Buffers (RoPE tables) were on meta: rebuild them for real, kept in float32.
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings).to(device)
    return model


def read_hf_config(path: Path, trust_remote_code: bool):
    """The checkpoint's transformers config, config.json checked before transformers parses
    it: transformers refuses some impossible values itself, in words that name neither the
    file nor (a ZeroDivisionError) the field."""
    from transformers import AutoConfig

    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except ValueError:
        raw = None  # not JSON: transformers' own error names the file
    if isinstance(raw, dict):
        check_config(raw, str(file))
    return hf_from_pretrained(AutoConfig, path, trust_remote_code, "the config")


def hf_from_pretrained(auto_class, path, trust_remote_code: bool, what: str):
    """``auto_class.from_pretrained(path)`` with ``trust_remote_code`` always passed: given
    False, transformers neither asks on stdin nor runs the checkpoint's own code, and a
    checkpoint that needs it is refused naming ``what`` needs it."""
    try:
        return auto_class.from_pretrained(path, trust_remote_code=bool(trust_remote_code))
    except ValueError as err:
        if trust_remote_code or "trust_remote_code" not in str(err):
            raise
        raise ValueError(f"{what} of checkpoint {str(path)!r} needs code from the checkpoint "
                         f"(an auto_map in its JSON files names its own .py), which runs only "
                         f"with trust_remote_code=True") from None


def _checkpoint_dir(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} has no config.json")
    return path


def resolve_dtype(dtype, hf_config, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        ckpt = getattr(torch, ckpt) if isinstance(ckpt, str) else (ckpt or torch.float32)
        # Half precision matmuls are slow or missing on CPU; bfloat16 is fine there.
        return torch.float32 if device.type == "cpu" and ckpt == torch.float16 else ckpt
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'")
    return getattr(torch, dtype)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files Hugging Face reads: those model.safetensors.index.json names, else
    model.safetensors. Any other *.safetensors in the folder (a backup, a stray download) is
    never read, so it can never replace a weight."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_index_files(path, index)))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint shard(s) missing in {path}: {', '.join(missing)}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    others = sorted(f.name for f in path.glob("*.safetensors"))
    if not others:
        raise FileNotFoundError(f"no *.safetensors weights in checkpoint directory {str(path)!r}")
    raise FileNotFoundError(f"checkpoint directory {str(path)!r} has neither model.safetensors nor "
                            f"model.safetensors.index.json (found {', '.join(others)}: which of them "
                            f"are the weights is not said, so none is read)")


def _index_files(path: Path, index: Path) -> list[str]:
    """The file names the index's weight_map gives, each checked to name a file of the folder
    before any is opened: an index must not make the loader read a file elsewhere (``../x``, an
    absolute path, a folder linked from elsewhere). The file itself may be a link, as the
    Hugging Face cache lays out a snapshot (its files link to the cache's blobs): like a lone
    ``model.safetensors``, it is the folder's own member."""
    try:
        data = json.loads(index.read_text())
    except ValueError as err:
        raise ValueError(f"cannot read checkpoint index {index}: {err}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        found = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
        raise ValueError(f"checkpoint index {index}: weight_map must be a JSON object mapping "
                         f"tensor names to file names, but it is {found}")
    root = path.resolve()
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(f"checkpoint index {index}: weight_map entry {name!r} -> {file!r}: "
                             f"the file name is not a string")
        target = (root / file).parent.resolve() / Path(file).name  # folders resolved, not the file
        if Path(file).is_absolute() or ".." in Path(file).parts or not target.is_relative_to(root):
            raise ValueError(f"checkpoint index {index}: weight_map entry {name!r} -> {file!r} "
                             f"names a file outside the checkpoint directory {root} (it is "
                             f"{target}); nothing outside it is read")
    return list(weight_map.values())


# HF parameter names -> (our parameter, slice of the fused tensor it fills)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Tensors some checkpoints carry that no model reads (rotary tables are recomputed).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _load_weights(model: CausalLM, path: Path, dtype: torch.dtype) -> None:
    """Every parameter from the checkpoint, exactly once: a missing one, one the config does
    not use, a wrong shape or a NaN / inf value is refused, naming the tensor and its file."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, int | None]] = set()
    held: dict[str, torch.Tensor] = {}  # a tied config's stored lm_head.weight, placed last
    for file in safetensors_files(path):
        loaded |= _load_file(model, file, dtype, held)
    if model.config.tie_word_embeddings:
        loaded |= _tie_as_transformers(model, held.get(_HEAD), loaded, path)
    missing = [name for name, part in _expected_parts(params) if (name, part) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(set(missing))[:8])}")


def _load_file(model: CausalLM, file: Path, dtype: torch.dtype, held: dict) -> set:
    """Copy one safetensors file into the parameters; returns the parts it filled (a tied
    config's lm_head.weight goes to ``held``). A damaged file's error names the file (the
    library's own message does not)."""
    from safetensors import SafetensorError, safe_open

    loaded, unused = set(), []
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if model.config.tie_word_embeddings and name.removeprefix("model.") == _HEAD:
                    held[_HEAD] = _checked_head(model, f.get_tensor(name), name, file, dtype)
                    continue
                part = _copy_weight(model, name, f.get_tensor(name), file)
                if part is None:
                    unused.append(name)
                else:
                    loaded.add(part)
    except SafetensorError as err:
        raise ValueError(f"cannot read checkpoint file {file}: {err}") from err
    if unused:
        raise ValueError(_unused_message(model.config, file, unused))
    return loaded


_HEAD, _EMBEDDING = "lm_head.weight", "embed_tokens.weight"


def _checked_head(model: CausalLM, tensor: torch.Tensor, name: str, file: Path, dtype) -> torch.Tensor:
    """A tied config's stored lm_head, checked as every weight is, in the model's dtype."""
    expected = tuple(model.embed_tokens.weight.shape)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {expected}")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"weight {name} in checkpoint file {file} has NaN or infinite values; "
                         f"every output would be NaN, so the model is not run")
    return tensor.to(device=model.device, dtype=dtype)


def _tie_as_transformers(model: CausalLM, head: torch.Tensor | None, loaded: set, path: Path) -> set:
    """A tied config, as transformers 5's from_pretrained ties it: an lm_head.weight stored
    without the embedding is the embedding too; one equal to it changes nothing; one with
    other values unties the two, each as stored (a warning says so). Returns the parts filled."""
    filled = {(_HEAD, None), (_EMBEDDING, None)}
    if head is None:
        return {(_HEAD, None)}
    with torch.no_grad():
        if (_EMBEDDING, None) not in loaded:
            model.embed_tokens.weight.copy_(head)
        elif not torch.equal(head, model.embed_tokens.weight):
            model.lm_head.weight = nn.Parameter(head)
            model.config.tie_word_embeddings = False
            warnings.warn(f"checkpoint {path}: config.json ties the embeddings "
                          f"(tie_word_embeddings true) but the weights also store lm_head.weight "
                          f"with other values; loaded as transformers loads it: untied, each "
                          f"weight as stored", stacklevel=4)
    return filled


def _unused_message(cfg: ModelConfig, file: Path, names: list[str]) -> str:
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return (f"checkpoint file {file} holds weights that config.json's {cfg.architecture} does "
            f"not use: {', '.join(names[:5])}{more} (num_hidden_layers={cfg.num_layers}, "
            f"biases q/k/v {cfg.qkv_bias}, o {cfg.o_bias}, mlp {cfg.mlp_bias}); the weights "
            f"and the config disagree, so the model is not run")


def _expected_parts(params: dict):
    for name in params:
        fused = name.split(".")[-2]
        count = {"qkv_proj": 3, "gate_up_proj": 2}.get(fused)
        if count is None:
            yield name, None
        else:
            yield from ((name, i) for i in range(count))


def _copy_weight(model, hf_name: str, tensor: torch.Tensor, file: Path):
    """Load one checkpoint tensor into its (possibly fused) parameter; returns what it filled
    (None: no parameter of this model takes it)."""
    target = _weight_target(model, hf_name, tensor, f"checkpoint file {file}", missing_ok=True)
    if target is None:
        return None
    with torch.no_grad():  # in place on the parameter itself: its version counter moves
        target.load()
    return target.param_name, target.index


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes, checked: ``rows`` of ``part``'s tensor ``name``, as
    the part's weight format loads it (``param_name``: the model's parameter; ``index``: which
    slice of a fused q/k/v or gate/up parameter, None for the whole; ``dtype``: the model's)."""

    part: nn.Module
    name: str
    rows: slice
    tensor: torch.Tensor
    param_name: str
    index: int | None
    dtype: torch.dtype

    def load(self) -> None:
        format_of(self.part).load(self.part, self.name, self.tensor, self.rows, self.dtype)


def fused_name(hf_name: str) -> tuple[str, int | None]:
    """A checkpoint tensor's parameter here and which slice of it (q, k, v: 0, 1, 2; gate, up:
    0, 1; None: the whole): ``layers.0.self_attn.k_proj.bias`` -> (``layers.0.self_attn.qkv_proj.bias``, 1)."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), index
    return name, None


def _weight_target(model, hf_name: str, tensor: torch.Tensor, source: str,
                   missing_ok: bool = False) -> WeightTarget | None:
    """The checked ``WeightTarget`` of one checkpoint tensor; None (``missing_ok``) or
    ValueError when no parameter takes it. Its shape is the one its part's format expects."""
    name, index = fused_name(hf_name)
    module_name, _, tensor_name = name.rpartition(".")
    part = _submodule(model, module_name)
    rows = ALL_ROWS if index is None else _fused_rows(model, module_name.split(".")[-1], index)
    expected = None if part is None else format_of(part).expected_shape(part, tensor_name, tensor, rows)
    if expected is None:
        if missing_ok:
            return None
        raise ValueError(f"{source}: no parameter of this {model.config.architecture} takes "
                         f"weight {hf_name!r}")
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"weight {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"weight {hf_name} in {source} has NaN or infinite values; "
                         f"every output would be NaN, so the model is not run")
    return WeightTarget(part, tensor_name, rows, tensor, name, index, model.dtype)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _fused_rows(model: CausalLM, fused: str, index: int) -> slice:
    """The rows of a fused parameter that q, k or v (gate or up) fill."""
    cfg = model.config
    if fused == "gate_up_proj":
        return slice(index * cfg.intermediate_size, (index + 1) * cfg.intermediate_size)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv))[index]


# ----------------------------------------------------------------------------- weight formats
# ``quantization="int8"`` (or any name core/formats.py registers): after loading, every linear
# (the LM head too) and, as the format decides, the embedding keep their weight in that format
# (core/weight_format.py). A ``FormatLinear`` / ``FormatEmbedding`` holds the parameters its
# format made and asks the format for everything: here, the dequantized weight in the
# activations' dtype, so the layer computes as before (the spec); a backend may compute from the
# stored values directly (same parameters, the seam above).


class FormatLinear(Replaceable, kind="format_linear"):
    """A linear whose weight ``weight_format`` stores (its parameters by the format's names,
    e.g. ``weight`` and ``weight_scale``), and a float ``bias`` or None."""

    def __init__(self, weight_format: WeightFormat, parameters: Mapping[str, nn.Parameter],
                 shape: tuple[int, int], bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight_format = weight_format
        self.out_features, self.in_features = shape
        for name, param in parameters.items():
            self.register_parameter(name, param)
        self.bias = bias

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @classmethod
    def of(cls, linear: nn.Linear, weight_format: WeightFormat) -> FormatLinear:
        """``linear`` with its weight in ``weight_format`` (its bias as it is)."""
        part = cls(weight_format, _created(weight_format, linear.weight), tuple(linear.weight.shape),
                   linear.bias)
        with torch.no_grad():
            weight_format.load(part, "weight", linear.weight.detach())
        return part

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_format.apply(self, x)


class FormatEmbedding(nn.Module):
    """The token embedding in ``weight_format``, looked up in ``dtype`` (a tied LM head shares
    its parameters: ``tied_head``)."""

    def __init__(self, weight_format: WeightFormat, parameters: Mapping[str, nn.Parameter],
                 shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_format, self.dtype = weight_format, dtype
        self.num_embeddings, self.embedding_dim = shape
        for name, param in parameters.items():
            self.register_parameter(name, param)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    @classmethod
    def of(cls, embedding: nn.Embedding, weight_format: WeightFormat,
           dtype: torch.dtype) -> FormatEmbedding:
        part = cls(weight_format, _created(weight_format, embedding.weight),
                   tuple(embedding.weight.shape), dtype)
        with torch.no_grad():
            weight_format.load(part, "weight", embedding.weight.detach())
        return part

    def tied_head(self) -> FormatLinear:
        """An LM head on these very parameters."""
        return FormatLinear(self.weight_format, dict(self.named_parameters()), self.weight_shape, None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_format.embed(self, input_ids, self.dtype)


def _created(weight_format: WeightFormat, weight: torch.Tensor) -> dict[str, nn.Parameter]:
    return weight_format.create_weights(*weight.shape, weight.dtype, weight.device)


def format_of(part: nn.Module) -> WeightFormat:
    """The format that loads ``part``'s parameters: its own, or as stored."""
    return getattr(part, "weight_format", None) or UNQUANTIZED


def _in_format(linear: Linear, weight_format: WeightFormat, name: str) -> FormatLinear:
    """``linear`` in ``weight_format``; a shape the format refuses is refused naming the part."""
    try:
        return FormatLinear.of(linear, weight_format)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _empty_in_format(model: CausalLM, name: str, weight_format: WeightFormat) -> None:
    """Replace the part ``name`` (a model.py ``Linear``, or ``embed_tokens``) by one in
    ``weight_format`` with empty parameters; a shape the format refuses is refused naming it."""
    part = model.get_submodule(name)
    rows, columns = part.weight.shape
    try:
        created = weight_format.create_weights(rows, columns, model.dtype, part.weight.device)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if name == "embed_tokens":
        model.embed_tokens = FormatEmbedding(weight_format, created, (rows, columns), model.dtype)
        return
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child,
            FormatLinear(weight_format, created, (rows, columns), part.bias))


def quantized(model: CausalLM, quantization: str | None) -> CausalLM:
    """``model`` with its weights in the format ``quantization`` names (None: as loaded), in
    place: every model.py ``Linear`` (a subclass with its own math is left as it is) and, as
    the format decides, the embedding; a tied LM head shares the embedding's."""
    weight_format = formats.weight_format(quantization)
    if weight_format is None:
        return model.eval()
    tied = model.config.tie_word_embeddings
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is Linear and not (tied and child is model.lm_head):
                setattr(module, name, _in_format(child, weight_format, f"{prefix}.{name}".lstrip(".")))
    embedding_format = weight_format.embedding_format()
    if embedding_format is not None:
        model.embed_tokens = FormatEmbedding.of(model.embed_tokens, embedding_format, model.dtype)
        if tied:
            model.lm_head = model.embed_tokens.tied_head()
    model.quantization = weight_format.name
    return model.eval()
