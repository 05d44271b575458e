// The glue between a layer's linears, one call where PyTorch spends several small ops each:
// RMSNorm of the hidden rows, and for the query and key heads (optional) RMSNorm then
// rotate-half RoPE. Rounded as model.py rounds: normalise in float32, round to the model's
// dtype, multiply by the weight and round again; RoPE's product and its update each rounded.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t ELEMENTS_PER_TASK = 16384;  // below this a call stays on one thread

template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// Sum of squares with 16 partial sums, so the compiler vectorises it.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = static_cast<float>(x[i + j]);
      part[j] += v * v;
    }
  float total = 0.f;
  for (; i < n; ++i) total += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  for (int j = 0; j < 16; ++j) total += part[j];
  return total;
}

// row[d] = round(round(x[d] * r) * w[d]) (float32: no rounding), kept as floats.
template <typename T>
inline void norm_row(const T* x, const T* w, int64_t n, double eps, float* row) {
  const float r = 1.f / std::sqrt(static_cast<float>(sum_squares(x, n) / n + eps));
  for (int64_t d = 0; d < n; ++d)
    row[d] = round_to<T>(round_to<T>(static_cast<float>(x[d]) * r) * static_cast<float>(w[d]));
}

// out = (x1 c - x2 s, x2 c + x1 s) per half, with c, s this token's [D/2] angles.
template <typename T>
inline void rope_row(const float* x, const T* c, const T* s, int64_t half, T* out) {
  for (int64_t d = 0; d < half; ++d) {
    const float cd = static_cast<float>(c[d]), sd = static_cast<float>(s[d]);
    out[d] = static_cast<T>(round_to<T>(x[d] * cd) - x[d + half] * sd);
    out[d + half] = static_cast<T>(round_to<T>(x[d + half] * cd) + x[d] * sd);
  }
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && (x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, what,
              ": a CPU tensor of 2 or 3 dims with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
              x.scalar_type() == at::kHalf, what, ": float32, bfloat16 or float16");
}

// Row i of x viewed as [T, H, D] (a 2-dim x: H = 1).
struct Rows {
  int64_t tokens, heads, dim, token_stride, head_stride;
  explicit Rows(const at::Tensor& x)
      : tokens(x.size(0)), heads(x.dim() == 3 ? x.size(1) : 1), dim(x.size(-1)), token_stride(x.stride(0)),
        head_stride(x.dim() == 3 ? x.stride(1) : 0) {}
  int64_t count() const { return tokens * heads; }
  int64_t offset(int64_t i) const { return (i / heads) * token_stride + (i % heads) * head_stride; }
  int64_t grain() const { return std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(dim, 1)); }
};

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const Rows rows(x);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows.count(), rows.grain(), [&](int64_t begin, int64_t end) {
    std::vector<float> row(rows.dim);
    for (int64_t i = begin; i < end; ++i) {
      norm_row(xp + rows.offset(i), wp, rows.dim, eps, row.data());
      for (int64_t d = 0; d < rows.dim; ++d) op[i * rows.dim + d] = static_cast<T>(row[d]);
    }
  });
}

template <typename T>
void norm_rope_rows(const at::Tensor& x, const at::Tensor* w, double eps, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor& out) {
  const Rows rows(x);
  const int64_t half = rows.dim / 2;
  const T* xp = x.data_ptr<T>();
  const T* wp = w != nullptr ? w->data_ptr<T>() : nullptr;
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows.count(), rows.grain(), [&](int64_t begin, int64_t end) {
    std::vector<float> row(rows.dim);
    for (int64_t i = begin; i < end; ++i) {
      const T* src = xp + rows.offset(i);
      if (wp != nullptr) norm_row(src, wp, rows.dim, eps, row.data());
      else for (int64_t d = 0; d < rows.dim; ++d) row[d] = static_cast<float>(src[d]);
      const int64_t token = i / rows.heads;
      rope_row(row.data(), cp + token * cos.stride(0), sp + token * sin.stride(0), half, op + i * rows.dim);
    }
  });
}

}  // namespace

// x [..., D], weight [D]: a new contiguous tensor of x's shape. [T, D] and [T, H, D] with
// contiguous rows are read in place; any other layout is copied into rows first.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.dim() >= 1, "rms_norm: x [..., D]");
  const bool in_place = (x_in.dim() == 2 || x_in.dim() == 3) && x_in.stride(-1) == 1;
  const at::Tensor x = in_place ? x_in : x_in.reshape({-1, x_in.size(-1)}).contiguous();
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == x.size(-1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type() && weight.device().is_cpu(),
              "rms_norm: weight [D] of x's dtype on the CPU");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { norm_rows<scalar_t>(x, weight, eps, out); });
  return out.view(x_in.sizes());
}

// x [T, H, D] (rows contiguous), weight [D] or none (no norm), cos and sin [T, >= D/2] of
// x's dtype (each token's angles; cos's first D/2 columns are used): a new [T, H, D].
at::Tensor norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                     const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "norm_rope");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "norm_rope: x [T, H, D] with an even D");
  const bool has_weight = weight.has_value() && weight->defined();
  TORCH_CHECK(!has_weight || (weight->dim() == 1 && weight->numel() == x.size(2) && weight->is_contiguous() &&
                              weight->scalar_type() == x.scalar_type() && weight->device().is_cpu()),
              "norm_rope: weight [D] of x's dtype on the CPU");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) >= x.size(2) / 2 && t->stride(1) == 1 &&
                t->scalar_type() == x.scalar_type() && t->device().is_cpu(),
                "norm_rope: cos and sin [T, >= D/2] of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_rope", [&] {
    norm_rope_rows<scalar_t>(x, has_weight ? &*weight : nullptr, eps, cos, sin, out);
  });
  return out;
}
