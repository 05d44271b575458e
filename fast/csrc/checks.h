// Boundary checks the linear kernels share: what a kernel reads besides x and the weight is
// checked where Python calls it, so a wrong operand raises instead of being read out of bounds.
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

// scale: one float per weight row, on the CPU.
inline void check_row_scales(const at::Tensor& scale, int64_t n, const char* name) {
  TORCH_CHECK(scale.numel() == n && scale.dim() <= 2 && scale.device().is_cpu() &&
                  at::isFloatingType(scale.scalar_type()),
              name, ": one float scale per weight row ([", n, "]) on the CPU, got ", scale.sizes(), " ",
              scale.scalar_type(), " on ", scale.device());
}
