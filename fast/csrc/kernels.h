// The fast layer's C++ kernels, as the files that define them export them: bindings.cpp binds
// them for Python, decode_layer.cpp composes them into a decoder layer.
#pragma once
#include <ATen/ATen.h>

#include <vector>

at::Tensor decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor rows,
                            at::Tensor tables, at::Tensor lo, at::Tensor hi, int64_t block_size,
                            double scale, at::Tensor out, bool vector);
bool prefill_attention_available();
at::Tensor prefill_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor first_token,
                             at::Tensor starts, at::Tensor lengths, at::Tensor tables, int64_t block_size,
                             double scale, int64_t window, at::Tensor out);
at::Tensor shared_decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor rows,
                                   at::Tensor tables, at::Tensor hi, int64_t shared_blocks, int64_t block_size,
                                   double scale, at::Tensor out);
bool small_linear_available();
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, bool silu_mul);
bool int8_linear_available();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool silu_mul);
bool int8_tiles_available();
at::Tensor int8_tiles(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias, bool silu_mul);
at::Tensor int8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype);
bool block_linear_available();
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias, int64_t bits, bool silu_mul);
at::Tensor block_dequantize(const at::Tensor& weight, const at::Tensor& scale, int64_t bits, at::ScalarType dtype);
bool lane_linear_available();
at::Tensor lane_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t format, bool silu_mul);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                     const at::Tensor& cos, const at::Tensor& sin);

// What decode_layer reads of one decoder layer besides its input and the step's attention:
// built once per layer and kept (fast/decode_layer.py builds it again when any of it changes).
// norms: the input and post-attention norms' weights; kinds, weights, scales, biases: qkv, o,
// gate/up (stacked), down; q_norm / k_norm: each head's norm (Qwen3) or none; scale: the
// attention's 1 / sqrt(head_dim).
struct LayerWeights {
  LayerWeights(std::vector<at::Tensor> norms, double eps, std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
               std::vector<c10::optional<at::Tensor>> scales, std::vector<c10::optional<at::Tensor>> biases,
               c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double head_eps, double scale);
  std::vector<at::Tensor> norms;
  double eps;
  std::vector<int64_t> kinds;
  std::vector<at::Tensor> weights;
  std::vector<c10::optional<at::Tensor>> scales, biases;
  c10::optional<at::Tensor> q_norm, k_norm;
  double head_eps, scale;
};

at::Tensor decode_layer(const at::Tensor& x, const LayerWeights& layer, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor pool_k, at::Tensor pool_v, const at::Tensor& slots, const at::Tensor& rows,
                        const at::Tensor& tables, const at::Tensor& lo, const at::Tensor& hi, int64_t block_size);
