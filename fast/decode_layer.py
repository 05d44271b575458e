"""A decode step's decoder layer in one compiled call: the fast layer's last step of glue.

At a decode step of one or a few sequences every kernel of a layer is quick, and what is left
is the Python between them: some fifteen calls and tensor ops per layer. When a step is all
decode rows on the decode attention kernel, ``KernelDecodeLayer`` computes each
``model.DecoderLayer`` by ``decode_layer`` (fast/csrc/decode_layer.cpp): the very kernels the
layer's parts would run, chosen by the same replacements for this row count, composed in C++ in
model.py's order. The result is the parts' own, bit for bit (tests/test_decode_layer.py).

Anything else leaves the layer to its parts (``DecoderLayer.compute``), so nothing is lost:
a prompt chunk in the step, shared-prefix decode, a forward hook on any part, a part that is
not model.py's own (a user's subclass), a linear whose kernel for this row count is not one
the C++ side names (``decode_kind`` returns None), a norm weight the kernels do not take.
"""
from __future__ import annotations

import operator

import torch
from torch import nn

from model import MLP, Attention, DecoderLayer

# A linear's kernel as fast/csrc/decode_layer.cpp names it (LINEAR_*): what a replacement's
# ``decode_kind(part, x)`` answers.
LINEAR_BF16 = 0        # small_linear
LINEAR_INT8 = 1        # int8_linear
LINEAR_INT8_TILES = 2  # int8_tiles
LINEAR_Q4_0 = 4        # block_linear, bits 4 (hands Q4_0 to lane_linear; int4 names LINEAR_LANES + 4)
LINEAR_Q8_0 = 8        # block_linear, bits 8
LINEAR_LANES = 10      # lane_linear: + its format (1 int8, 4 Q4_0, 8 Q8_0)


def parts_of(layer: DecoderLayer) -> tuple:
    """The modules a fused layer reads, in a fixed order (None where a model has none): read
    from the modules' own tables, as nn.Module's attribute lookup would, at a fraction of its
    cost (this runs per layer per step)."""
    own = layer._modules
    attn, mlp = own["self_attn"], own["mlp"]
    a, m = attn._modules, mlp._modules
    return (own["input_layernorm"], attn, a["qkv_proj"], a.get("q_norm"), a.get("k_norm"), a["rotation"],
            a["o_proj"], own["post_attention_layernorm"], mlp, m["gate_up_proj"], m["down_proj"])


def fusable(layer: DecoderLayer) -> bool:
    """model.py's own layer: its attention and MLP unchanged, every replaceable part declared."""
    if type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
        return False
    return all(part is None or not hasattr(part, "computes_as_declared") or part.computes_as_declared()
               for part in parts_of(layer))


class KernelDecodeLayer:
    """One ``model.DecoderLayer`` by ``decode_layer`` at an all-decode step; ``linears``: the
    replacements of its qkv, o, MLP (gate/up) and down projections.

    What the C++ call reads of the layer (``LayerWeights``: parameters, eps, each linear's
    kernel) is built once and kept with what it was read from (``read``); any of that which is
    another object at a later step -- a parameter replaced, another row count or dtype, an eps
    set -- builds it again. A write through ``param.data`` moves none of these, but the engine
    sees its storage move and derives everything again (``Backend.rederive``)."""

    def __init__(self, module, layer: DecoderLayer, linears: tuple) -> None:
        self.module, self.linears = module, linears
        self.parts = parts_of(layer)
        self.modules = tuple(part for part in self.parts if part is not None)
        self._read: tuple = ()
        self._weights = None

    def __call__(self, layer: DecoderLayer, x: torch.Tensor, plan, pool_k, pool_v, rope):
        decode = getattr(plan, "kernel_decode", None)
        weights = self.weights(layer, x) if decode is not None else None
        if weights is None:
            return layer.compute(x, plan, pool_k, pool_v, rope)
        return self.module.decode_layer(x, weights, rope[0], rope[1], pool_k, pool_v, plan.slot_mapping,
                                        decode.rows, decode.tables, decode.lo[self.parts[1].window], decode.hi,
                                        plan.block_size)

    def weights(self, layer: DecoderLayer, x: torch.Tensor):
        """The layer's ``LayerWeights`` for ``x``, or None where it must run part by part."""
        if parts_of(layer) != self.parts or x.dim() != 2 or not x.is_contiguous() or any_hooks(self.modules):
            return None
        read = self.read(x)
        if len(read) != len(self._read) or not all(map(operator.is_, read, self._read)):
            self._weights, self._read = self.build(x), read
        return self._weights

    def read(self, x: torch.Tensor) -> tuple:
        """Everything ``build`` reads, as objects: what the kept ``LayerWeights`` stands for."""
        norm_in, attn, qkv, q_norm, k_norm, _, o, norm_post, mlp, gate_up, down = self.parts
        out = [x.shape[0], x.dtype, mlp.hidden_act, attn.window, attn.head_dim, norm_in.eps, norm_post.eps,
               norm_in._parameters["weight"], norm_post._parameters["weight"]]
        for norm in (q_norm, k_norm):
            if norm is not None:
                out += (norm.eps, norm._parameters["weight"])
        for linear in (qkv, o, gate_up, down):
            params = linear._parameters
            out += (params["weight"], params.get("weight_scale"), params.get("bias"))
        return tuple(out)

    def build(self, x: torch.Tensor):
        """The layer's ``LayerWeights`` as its parts are now, or None (part by part)."""
        kinds = self.kinds(x)
        if kinds is None:
            return None
        norm_in, attn, qkv, q_norm, k_norm, _, o, norm_post, _, gate_up, down = self.parts
        linears = (qkv._parameters, o._parameters, gate_up._parameters, down._parameters)
        return self.module.LayerWeights(
            [norm_in._parameters["weight"], norm_post._parameters["weight"]], norm_in.eps, kinds,
            [p["weight"] for p in linears], [p.get("weight_scale") for p in linears],
            [p.get("bias") for p in linears],
            None if q_norm is None else q_norm._parameters["weight"],
            None if k_norm is None else k_norm._parameters["weight"],
            0.0 if q_norm is None else q_norm.eps, attn.head_dim ** -0.5)

    def kinds(self, x: torch.Tensor) -> list[int] | None:
        """Each linear's kernel for ``x``, or None where the layer must run part by part."""
        norm_in, attn, qkv, q_norm, k_norm, _, o, norm_post, mlp, _, down = self.parts
        if mlp.hidden_act != "silu" or norm_in.eps != norm_post.eps:
            return None
        if q_norm is not None and (k_norm is None or q_norm.eps != k_norm.eps):
            return None
        for norm in (norm_in, norm_post, q_norm, k_norm):
            weight = None if norm is None else norm._parameters["weight"]
            if weight is not None and (weight.dtype != x.dtype or not weight.is_contiguous()):
                return None  # the norm kernels take a contiguous weight of x's dtype
        kinds = [getattr(r, "decode_kind", _none)(p, x) for r, p in zip(self.linears, (qkv, o, mlp, down))]
        return None if None in kinds else kinds


def _none(part, x) -> None:
    return None


def any_hooks(modules: tuple) -> bool:
    hooks = nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in modules))


def layer_replacements(model: nn.Module, replacements: dict, module) -> dict:
    """A ``KernelDecodeLayer`` per decoder layer of ``model`` that is model.py's own, over
    ``replacements`` (the parts' own, part name -> callable)."""
    out = {}
    for name, part in model.replaceable_parts():
        if part.kind == "layer" and fusable(part):
            linears = tuple(replacements.get(f"{name}.{p}") for p in
                            ("self_attn.qkv_proj", "self_attn.o_proj", "mlp", "mlp.down_proj"))
            out[name] = KernelDecodeLayer(module, part, linears)
    return out
