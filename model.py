"""The decoder of step14_5, run on the paged KV pool: Llama, Qwen2, Qwen3 and Mistral.

One forward takes a packed batch: the prefill chunks and decode tokens of many sequences,
back to back, with their positions and block tables (``AttentionMetadata``). Each layer
writes the new tokens' K/V into their slots of the pool and attends over each sequence's
whole context through its block table. Pure PyTorch, so the same code runs on CPU and CUDA.

Reading order: config -> RoPE -> attention metadata -> layers -> model -> checkpoint loading.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM")


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
    def from_hf(cls, hf) -> "ModelConfig":
        arch = (getattr(hf, "architectures", None) or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            rope_parameters=_rope_parameters(hf), hidden_act=hf.hidden_act,
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            layer_windows=_layer_windows(hf), eos_token_ids=_as_tuple(hf.eos_token_id))


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


def _layer_windows(hf) -> tuple[int | None, ...]:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(hf, "use_sliding_window", None) is False:
        return (None,) * n
    return (window,) * n


# ----------------------------------------------------------------------------- RoPE

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
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


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


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position, indexed per token (positions differ per sequence)."""

    def __init__(self, head_dim: int, params: dict, max_position: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(head_dim, params, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, looked up once per forward and shared by all layers."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotate-half convention of HF checkpoints."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ----------------------------------------------------------------------------- attention metadata

@dataclass
class SeqChunk:
    """What one sequence contributes to a forward: positions [start, start + length)."""

    start: int
    length: int
    block_table: list[int]


@dataclass
class AttentionGroup:
    """Sequences attended together as one padded batch (decode tokens, or prefill chunks).

    Grouped-query attention is folded into the query axis: each KV head's ``g`` query heads
    become ``g`` rows per query position, so K/V are never repeated per query head.
    """

    query_index: torch.Tensor | slice  # packed tokens of the [B, Lq] padded queries
    block_tables: torch.Tensor  # [B * nb] each sequence's context blocks (after the shared ones)
    shared_blocks: torch.Tensor | None  # leading blocks every sequence holds (decode only)
    masks: dict                 # window (None = full) -> additive float [B, 1, Lq * g, nb * block_size]
    out_src: torch.Tensor | None  # flat index into B*Lq of real queries (None: no padding)
    out_dst: torch.Tensor | slice  # their packed-token index
    batch: int
    q_len: int
    fresh: bool = False  # one sequence computing positions [0, q_len): its K/V are this step's


@dataclass
class AttentionMetadata:
    """Everything the layers need about one packed batch; built once per step, shared by layers."""

    positions: torch.Tensor     # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, windows: set, queries_per_kv: int,
              dtype: torch.dtype, device: torch.device) -> "AttentionMetadata":
        lengths = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        tables = _pad_block_tables([c.block_table for c in chunks])
        first_token = np.cumsum(lengths) - lengths
        seq_of_token = np.repeat(np.arange(len(chunks)), lengths)
        positions = np.arange(lengths.sum()) - first_token[seq_of_token] + starts[seq_of_token]
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        spec = _GroupSpec(block_size, windows, queries_per_kv, dtype, device)
        # Decode tokens batch well; a prompt chunk from position 0 gets its own causal call (no
        # padding, half the scores skipped); chunks after a cached or computed prefix share one.
        fresh = (lengths > 1) & (starts == 0)
        selections = [lengths == 1, (lengths > 1) & (starts > 0)]
        selections += [np.arange(len(chunks)) == i for i in np.flatnonzero(fresh)]
        groups = [_build_group(np.flatnonzero(sel), lengths, starts, first_token, tables, spec)
                  for sel in selections if sel.any()]
        return cls(torch.from_numpy(positions).to(device), torch.from_numpy(slots).to(device),
                   groups)


@dataclass
class _GroupSpec:
    block_size: int
    windows: set
    queries_per_kv: int
    dtype: torch.dtype
    device: torch.device


def _pad_block_tables(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, :len(table)] = table
    return padded


def _build_group(rows, lengths, starts, first_token, tables, spec: _GroupSpec) -> AttentionGroup:
    lengths, starts, first_token = lengths[rows], starts[rows], first_token[rows]
    device, q_len = spec.device, int(lengths.max())
    num_ctx_blocks = -(-int((starts + lengths).max()) // spec.block_size)
    j = np.arange(q_len)
    # Padded query slots repeat the sequence's last token: finite output, then discarded.
    offset = np.minimum(j[None, :], lengths[:, None] - 1)
    query_index = first_token[:, None] + offset
    block_tables = tables[rows][:, :num_ctx_blocks]
    num_shared = _num_shared_blocks(block_tables, starts, spec.block_size, q_len)
    shared = torch.from_numpy(block_tables[0, :num_shared].copy()).to(device) if num_shared else None
    block_tables = np.ascontiguousarray(block_tables[:, num_shared:])
    fresh = len(rows) == 1 and starts[0] == 0 and q_len > 1
    # A fresh chunk needs masks only for sliding windows: full layers run is_causal.
    windows = {w for w in spec.windows if w is not None} if fresh else spec.windows
    masks = _masks(starts[:, None] + offset, num_ctx_blocks * spec.block_size, spec, windows)
    valid = j[None, :] < lengths[:, None]
    num_tokens = int(lengths.sum())
    if valid.all() and np.array_equal(query_index.ravel(), np.arange(num_tokens) + first_token[0]):
        # Unpadded and contiguous in the packed batch (always so for decode): plain slices.
        tokens = slice(int(first_token[0]), int(first_token[0]) + num_tokens)
        index, out_src, out_dst = tokens, None, tokens
    else:
        index = torch.from_numpy(query_index.ravel()).to(device)
        out_src = torch.from_numpy(np.flatnonzero(valid.ravel())).to(device)
        out_dst = torch.from_numpy(query_index[valid]).to(device)
    return AttentionGroup(index, torch.from_numpy(block_tables.ravel()).to(device), shared, masks,
                          out_src, out_dst, len(rows), q_len, fresh)


def _num_shared_blocks(block_tables: np.ndarray, starts: np.ndarray, block_size: int, q_len: int) -> int:
    """Leading blocks that every sequence of a decode group holds (a cached shared prefix)."""
    if q_len != 1 or len(block_tables) < 2:
        return 0
    same = (block_tables == block_tables[:1]).all(axis=0)
    shared = len(same) if same.all() else int(np.argmin(same))
    return min(shared, int(starts.min()) // block_size)


def _masks(q_pos: np.ndarray, kv_len: int, spec: _GroupSpec, windows: set) -> dict:
    """Additive masks per window, built once per step: whole blocks are gathered, so any
    position past a sequence's context is simply in its future."""
    q_pos = torch.from_numpy(q_pos).to(spec.device)
    k_pos = torch.arange(kv_len, device=spec.device)
    causal = k_pos[None, None, :] <= q_pos[:, :, None]
    masks = {}
    for window in windows:
        allowed = causal if window is None else causal & (k_pos[None, None, :] > q_pos[:, :, None] - window)
        allowed = allowed.repeat_interleave(spec.queries_per_kv, dim=1)  # GQA rows
        mask = torch.zeros(allowed.shape, dtype=spec.dtype, device=spec.device)
        masks[window] = mask.masked_fill_(~allowed, float("-inf"))[:, None]
    return masks


def paged_attention(q, k, v, kv, layer: int, meta: AttentionMetadata, window):
    """q: [T, H, D]; k, v: this step's [T, KVH, D], already written into the pool ``kv``."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k.shape[1:]
    group_size = q.shape[1] // num_kv_heads
    for g in meta.groups:
        q_sel = q[g.query_index] if isinstance(g.query_index, slice) else q.index_select(0, g.query_index)
        if g.fresh and window not in g.masks:
            out[g.out_dst] = _causal_prefill(q_sel, k[g.query_index], v[g.query_index])
            continue
        if g.shared_blocks is not None:
            out[g.out_dst] = shared_prefix_decode(q_sel, kv, layer, g, g.masks[window])
            continue
        qg = (q_sel.view(g.batch, g.q_len, num_kv_heads, group_size, head_dim)
              .transpose(1, 2).reshape(g.batch, num_kv_heads, g.q_len * group_size, head_dim))
        # Gathering whole blocks copies contiguous chunks: far cheaper than per-slot indexing.
        kg, vg = kv.gather(layer, g.block_tables, "context")
        kg = kg.view(g.batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        vg = vg.view(g.batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        res = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.masks[window])
        res = (res.view(g.batch, num_kv_heads, g.q_len, group_size, head_dim).transpose(1, 2)
               .reshape(g.batch * g.q_len, q.shape[1], head_dim))
        out[g.out_dst] = res if g.out_src is None else res[g.out_src]
    return out


def _causal_prefill(q, k, v):
    """A prompt chunk from position 0 attends only to itself: no gather, no mask, and the
    causal kernel skips the upper half of the scores."""
    res = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return res[0].transpose(0, 1)


def shared_prefix_decode(q, kv, layer: int, g: AttentionGroup, mask):
    """Decode attention when every sequence shares leading blocks (a common system prompt).

    The shared blocks are gathered once and scored for the whole batch with one matmul per
    KV head, instead of being copied once per sequence; only each sequence's own blocks are
    gathered per sequence. One softmax over both parts keeps it exact attention.
    """
    batch, heads, head_dim = q.shape
    ks, vs = kv.gather(layer, g.shared_blocks, "shared")
    ko, vo = kv.gather(layer, g.block_tables, "context")
    num_kv_heads = ks.shape[1]
    group_size = heads // num_kv_heads
    qh = q.view(batch, num_kv_heads, group_size, head_dim) * head_dim ** -0.5
    ko = ko.view(batch, -1, num_kv_heads, head_dim)
    vo = vo.view(batch, -1, num_kv_heads, head_dim)
    rows = qh.permute(1, 0, 2, 3).reshape(num_kv_heads, batch * group_size, head_dim)
    shared_len = ks.shape[0]
    s_shared = torch.matmul(rows, ks.permute(1, 2, 0)).view(num_kv_heads, batch, group_size, shared_len)
    s_own = torch.matmul(qh, ko.permute(0, 2, 3, 1))
    probs = (torch.cat((s_shared.permute(1, 0, 2, 3), s_own), dim=-1) + mask).softmax(dim=-1)
    p_shared = probs[..., :shared_len].permute(1, 0, 2, 3).reshape(num_kv_heads, batch * group_size, shared_len)
    out = torch.matmul(p_shared, vs.permute(1, 0, 2)).view(num_kv_heads, batch, group_size, head_dim)
    out = out.permute(1, 0, 2, 3) + torch.matmul(probs[..., shared_len:], vo.permute(0, 2, 1, 3))
    return out.reshape(batch, heads, head_dim)


# ----------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the checkpoints were trained to.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.window = layer, cfg.layer_windows[layer]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, meta: AttentionMetadata, kv, rope):
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kv.k[self.layer].index_copy_(0, meta.slot_mapping, k)
        kv.v[self.layer].index_copy_(0, meta.slot_mapping, v)
        out = paged_attention(q, k, v, kv, self.layer, meta, self.window)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, meta, kv, rope):
        x = x + self.self_attn(self.input_layernorm(x), meta, kv, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> norm -> lm_head, for the rows that need logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prepare(self, chunks: list[SeqChunk], block_size: int) -> AttentionMetadata:
        """Attention metadata for one packed batch, in this model's dtype and head layout."""
        cfg = self.config
        return AttentionMetadata.build(chunks, block_size, set(cfg.layer_windows),
                                       cfg.num_heads // cfg.num_kv_heads, self.embed_tokens.weight.dtype,
                                       self.embed_tokens.weight.device)

    @torch.inference_mode()
    def forward(self, input_ids, meta: AttentionMetadata, kv, logits_index) -> torch.Tensor:
        """Returns float32 logits for the packed tokens at ``logits_index``."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.lookup(meta.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, meta, kv, rope)
        return self.lm_head(self.norm(x[logits_index])).float()


# ----------------------------------------------------------------------------- loading

def load_model(path: str | Path, dtype: str | torch.dtype | None, device: torch.device):
    """Build the model from a local Hugging Face checkpoint directory."""
    from transformers import AutoConfig

    path = _checkpoint_dir(path)
    hf_config = AutoConfig.from_pretrained(path)
    cfg = ModelConfig.from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(torch_dtype)
    if cfg.tie_word_embeddings:  # to_empty() materialises shared parameters separately
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers (RoPE tables) were on meta: rebuild them for real, kept in float32.
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings).to(device)
    _load_weights(model, path, torch_dtype)
    return model.eval(), hf_config


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
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint shard(s) missing in {path}: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in checkpoint directory {str(path)!r}")
    return files


# HF parameter names -> (our parameter, slice of the fused tensor it fills)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _load_weights(model: CausalLM, path: Path, dtype: torch.dtype) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, int | None]] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = _copy_weight(model, params, name, f.get_tensor(name), dtype)
                if part:
                    loaded.add(part)
    if model.config.tie_word_embeddings:
        loaded.add(("lm_head.weight", None))
    missing = [name for name, part in _expected_parts(params) if (name, part) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(set(missing))[:8])}")


def _expected_parts(params: dict):
    for name in params:
        fused = name.split(".")[-2]
        count = {"qkv_proj": 3, "gate_up_proj": 2}.get(fused)
        if count is None:
            yield name, None
        else:
            yield from ((name, i) for i in range(count))


def _copy_weight(model, params, hf_name: str, tensor: torch.Tensor, dtype):
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns what it filled."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    index = None
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        name = ".".join(parts[:-2] + [fused, parts[-1]])
    param = params.get(name)
    if param is None:
        return None  # e.g. rotary inv_freq buffers some checkpoints carry
    target = param.data
    if index is not None:
        start, size = _fused_slice(model, name.split(".")[-2], index)
        target = target[start:start + size]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {hf_name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(tensor.to(dtype))
    return name, index


def _fused_slice(model: CausalLM, fused: str, index: int) -> tuple[int, int]:
    cfg = model.config
    if fused == "gate_up_proj":
        return index * cfg.intermediate_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return ((0, q), (q, kv), (q + kv, kv))[index]
