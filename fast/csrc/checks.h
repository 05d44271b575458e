// Boundary checks the linear kernels share: what a kernel reads besides x and the weight is
// checked where Python calls it, so a wrong operand raises instead of being read out of bounds;
// and the bias as they read it once checked.
#pragma once
#include <ATen/ATen.h>

// bias: none, or [n] floats on the CPU (the kernels read it converted to float32).
inline void check_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* name) {
  if (!bias.has_value() || !bias->defined()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->device().is_cpu() &&
                  at::isFloatingType(bias->scalar_type()),
              name, ": bias [N] = [", n, "] of floats on the CPU, got ", bias->sizes(), " ",
              bias->scalar_type(), " on ", bias->device());
}

// A checked bias as the kernels read it: float32 and contiguous (a converted copy, held), or none.
struct FloatBias {
  at::Tensor tensor;  // undefined without a bias
  explicit FloatBias(const c10::optional<at::Tensor>& bias)
      : tensor(bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor()) {}
  const float* data() const { return tensor.defined() ? tensor.data_ptr<float>() : nullptr; }
};

// scale: one float per weight row, on the CPU.
inline void check_row_scales(const at::Tensor& scale, int64_t n, const char* name) {
  TORCH_CHECK(scale.numel() == n && scale.dim() <= 2 && scale.device().is_cpu() &&
                  at::isFloatingType(scale.scalar_type()),
              name, ": one float scale per weight row ([", n, "]) on the CPU, got ", scale.sizes(), " ",
              scale.scalar_type(), " on ", scale.device());
}

// x [M, K] bfloat16 or float32 on the CPU: what the VNNI kernels quantize per block.
inline void check_block_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              name, ": x [M, K] bfloat16 or float32 on the CPU, got ", x.sizes(), " ", x.scalar_type());
}

// A llama.cpp block weight for inputs of K columns: Q4_0 (q4: uint8 [N, K / 2]) or Q8_0 (int8
// [N, K]), contiguous, with contiguous float16 block scales [N, K / 32]; K a multiple of 32.
inline void check_block_weight(const at::Tensor& weight, const at::Tensor& scale, bool q4, int64_t k,
                               const char* name) {
  constexpr int64_t block = 32;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu() &&
                  weight.scalar_type() == (q4 ? at::kByte : at::kChar),
              name, ": a contiguous ", q4 ? "uint8" : "int8", " CPU weight [N, ", q4 ? "K / 2" : "K", "], got ",
              weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(k % block == 0 && weight.size(1) == (q4 ? k / 2 : k), name, ": K = ", k,
              " must be a multiple of ", block, " and match the weight's ", weight.size(1), " columns");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == weight.size(0) && scale.size(1) == k / block &&
                  scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.device().is_cpu(),
              name, ": contiguous float16 block scales [N, K / 32] = [", weight.size(0), ", ", k / block,
              "] on the CPU, got ", scale.sizes(), " ", scale.scalar_type());
}
