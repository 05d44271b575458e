// A decode step's decoder layer in one call (fast/decode_layer.py decides when): the same kernels
// the layer's parts run one Python call each, composed here in model.py's order, so the result
// is the parts' own, bit for bit, without a Python call and a few tensor ops between each.
//
//   h = rms_norm(x); q, k, v = qkv(h); q, k = each head's norm + RoPE; K/V into the pool's slots;
//   a = decode attention; x = x + o(a); h = rms_norm(x); x += down(silu(gate(h)) * up(h))
//
// Each linear's kind names its kernel, as the fast layer chose it for this row count:
// LINEAR_* below. What the kernels check, they check here too.
#include <ATen/ATen.h>

#include <cstring>

#include "kernels.h"

namespace {

// The kernel of a linear (kinds[i]); fast/decode_layer.py names them alike.
constexpr int64_t LINEAR_BF16 = 0;        // small_linear: bfloat16 weight, a few rows
constexpr int64_t LINEAR_INT8 = 1;        // int8_linear: int8 weight, row scales
constexpr int64_t LINEAR_INT8_TILES = 2;  // int8_tiles: the same on AMX tiles
constexpr int64_t LINEAR_Q4_0 = 4;        // block_linear, bits 4 (hands Q4_0 to lane_linear)
constexpr int64_t LINEAR_Q8_0 = 8;        // block_linear, bits 8
constexpr int64_t LINEAR_LANES = 10;      // lane_linear: + its format (1 int8, 4 Q4_0, 8 Q8_0)

at::Tensor linear(int64_t kind, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& bias, bool silu_mul) {
  const bool scaled = scale.has_value() && scale->defined();
  switch (kind) {
    case LINEAR_BF16:
      return small_linear(x, weight, bias, silu_mul);
    case LINEAR_INT8:
    case LINEAR_INT8_TILES:
    case LINEAR_Q4_0:
    case LINEAR_Q8_0:
    case LINEAR_LANES + 1:
    case LINEAR_LANES + 4:
    case LINEAR_LANES + 8:
      TORCH_CHECK(scaled, "decode_layer: linear kind ", kind, " needs its weight's scales");
      if (kind == LINEAR_INT8) return int8_linear(x, weight, *scale, bias, silu_mul);
      if (kind == LINEAR_INT8_TILES) return int8_tiles(x, weight, *scale, bias, silu_mul);
      if (kind > LINEAR_LANES) return lane_linear(x, weight, *scale, bias, kind - LINEAR_LANES, silu_mul);
      return block_linear(x, weight, *scale, bias, kind, silu_mul);
  }
  TORCH_CHECK(false, "decode_layer: no linear kind ", kind);
}

// model.write_kv: each row's K and V heads ([B, KVH, D]) into its slot of the pools [KVH, slots, D].
void write_kv(at::Tensor& pool, const at::Tensor& kv, const int64_t* slots) {
  const int64_t rows = kv.size(0), heads = kv.size(1), dim = kv.size(2), size = pool.size(1);
  const int64_t bytes = dim * kv.element_size();
  auto* dst = static_cast<char*>(pool.data_ptr());
  const auto* src = static_cast<const char*>(kv.data_ptr());
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(0 <= slots[b] && slots[b] < size, "decode_layer: slot ", slots[b], " outside the pool");
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (h * size + slots[b]) * bytes,
                  src + (b * kv.stride(0) + h * kv.stride(1)) * kv.element_size(), bytes);
  }
}

}  // namespace

LayerWeights::LayerWeights(std::vector<at::Tensor> norms_, double eps_, std::vector<int64_t> kinds_,
                           std::vector<at::Tensor> weights_, std::vector<c10::optional<at::Tensor>> scales_,
                           std::vector<c10::optional<at::Tensor>> biases_, c10::optional<at::Tensor> q_norm_,
                           c10::optional<at::Tensor> k_norm_, double head_eps_, double scale_)
    : norms(std::move(norms_)), eps(eps_), kinds(std::move(kinds_)), weights(std::move(weights_)),
      scales(std::move(scales_)), biases(std::move(biases_)), q_norm(std::move(q_norm_)),
      k_norm(std::move(k_norm_)), head_eps(head_eps_), scale(scale_) {
  TORCH_CHECK(norms.size() == 2 && kinds.size() == 4 && weights.size() == 4 && scales.size() == 4 &&
                  biases.size() == 4, "decode_layer: two norms and four linears (qkv, o, gate/up, down)");
}

// x [B, hidden]; layer: its weights (above); cos [B, 1, D], sin [B, 1, D / 2]: RoPE of each
// row's position; pools [KVH, slots, D]; slots [B]: where each row's K/V go; rows, tables, lo,
// hi, block_size: decode_attention's.
at::Tensor decode_layer(const at::Tensor& x, const LayerWeights& layer, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor pool_k, at::Tensor pool_v, const at::Tensor& slots, const at::Tensor& rows,
                        const at::Tensor& tables, const at::Tensor& lo, const at::Tensor& hi, int64_t block_size) {
  const auto& [norms, eps, kinds, weights, scales, biases, q_norm, k_norm, head_eps, scale] = layer;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x [B, hidden], contiguous");
  const int64_t batch = x.size(0), kv_heads = pool_k.size(0), dim = pool_k.size(2);
  TORCH_CHECK(pool_k.dim() == 3 && pool_k.sizes() == pool_v.sizes() && pool_k.is_contiguous() &&
                  pool_v.is_contiguous() && pool_k.scalar_type() == x.scalar_type() &&
                  pool_v.scalar_type() == x.scalar_type(),
              "decode_layer: contiguous pools [KVH, slots, D] of x's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == batch,
              "decode_layer: one int64 slot per row");
  TORCH_CHECK(cos.dim() == 3 && sin.dim() == 3, "decode_layer: cos and sin [B, 1, *]");

  const at::Tensor qkv = linear(kinds[0], rms_norm(x, norms[0], eps), weights[0], scales[0], biases[0], false);
  const int64_t heads = qkv.size(1) / dim - 2 * kv_heads;
  TORCH_CHECK(heads > 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "decode_layer: qkv's width ", qkv.size(1), " is not (heads + 2 x ", kv_heads, ") x ", dim);
  const at::Tensor split = qkv.view({batch, heads + 2 * kv_heads, dim});
  const at::Tensor c = cos.select(1, 0), s = sin.select(1, 0);
  const at::Tensor q = norm_rope(split.narrow(1, 0, heads), q_norm, head_eps, c, s);
  const at::Tensor k = norm_rope(split.narrow(1, heads, kv_heads), k_norm, head_eps, c, s);
  write_kv(pool_k, k, slots.data_ptr<int64_t>());
  write_kv(pool_v, split.narrow(1, heads + kv_heads, kv_heads), slots.data_ptr<int64_t>());
  at::Tensor attended = at::empty_like(q);
  decode_attention(q, pool_k, pool_v, rows, tables, lo, hi, block_size, scale, attended, true);

  at::Tensor out = x + linear(kinds[1], attended.view({batch, heads * dim}), weights[1], scales[1], biases[1], false);
  const at::Tensor gated = linear(kinds[2], rms_norm(out, norms[1], eps), weights[2], scales[2], biases[2], true);
  return out.add_(linear(kinds[3], gated, weights[3], scales[3], biases[3], false));
}
