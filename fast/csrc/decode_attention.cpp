// Decode attention over the paged KV pool: one query token per sequence, every query head of a
// KV head group at once, keys and values read straight from their blocks (no gather, no
// padding), softmax in float32. The same result as model.py's paged_attention for these rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// One row of D values as float32. bfloat16 is the top half of a float32: a shift the compiler
// vectorizes (c10's scalar conversion it does not).
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
}
inline void load_row(const double* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// A dot product in LANES independent partial sums, so the compiler vectorizes it without
// being allowed to reorder float additions (-ffast-math) anywhere else.
constexpr int64_t LANES = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float part[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * b[d];
  for (int64_t l = 0; l < LANES; ++l) s += part[l];
  return s;
}

template <typename T>
void attend_group(const T* q, const T* pool_k, const T* pool_v, const int64_t* table,
                  int64_t lo, int64_t hi, int64_t block_size, int64_t group, int64_t dim,
                  float scale, T* out, int64_t out_stride) {
  const int64_t count = hi - lo;
  std::vector<float> query(group * dim), scores(group * count), acc(group * dim, 0.f);
  load_row(q, query.data(), group * dim);
  for (int64_t i = 0; i < group * dim; ++i) query[i] *= scale;
  std::vector<float> row(dim);
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    load_row(pool_k + slot * dim, row.data(), dim);
    for (int64_t g = 0; g < group; ++g)
      scores[g * count + (p - lo)] = dot(query.data() + g * dim, row.data(), dim);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * count;
    const float peak = *std::max_element(sg, sg + count);
    float total = 0.f;
    for (int64_t j = 0; j < count; ++j) total += (sg[j] = std::exp(sg[j] - peak));
    for (int64_t j = 0; j < count; ++j) sg[j] /= total;
  }
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    load_row(pool_v + slot * dim, row.data(), dim);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * count + (p - lo)];
      float* ag = acc.data() + g * dim;
      for (int64_t d = 0; d < dim; ++d) ag[d] += w * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * out_stride + d] = static_cast<T>(acc[g * dim + d]);
}

}  // namespace

// q [B, H, D]; pool_k, pool_v [KVH, slots, D]; tables [B, blocks] int64; lo, hi [B] int64
// (the visible key positions of each row); returns [B, H, D] in q's dtype.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor pool_k, torch::Tensor pool_v,
                               torch::Tensor tables, torch::Tensor lo, torch::Tensor hi,
                               int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && pool_k.dim() == 3 && pool_k.sizes() == pool_v.sizes());
  TORCH_CHECK(q.scalar_type() == pool_k.scalar_type() && pool_k.scalar_type() == pool_v.scalar_type());
  TORCH_CHECK(pool_k.is_contiguous() && pool_v.is_contiguous());
  TORCH_CHECK(q.device().is_cpu() && pool_k.device().is_cpu(), "decode_attention runs on CPU");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lo.scalar_type() == at::kLong &&
              hi.scalar_type() == at::kLong && lo.is_contiguous() && hi.is_contiguous());
  TORCH_CHECK(tables.size(0) == q.size(0) && lo.numel() == q.size(0) && hi.numel() == q.size(0));
  q = q.contiguous();
  tables = tables.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && pool_k.size(2) == dim);
  auto out = torch::empty_like(q);
  const int64_t* lo_p = lo.data_ptr<int64_t>();
  const int64_t* hi_p = hi.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = pool_k.data_ptr<scalar_t>();
    const scalar_t* vp = pool_v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / kv_heads, h = i % kv_heads;
        attend_group<scalar_t>(qp + (b * heads + h * group) * dim, kp + h * slots * dim,
                               vp + h * slots * dim, tab + b * width, lo_p[b], hi_p[b],
                               block_size, group, dim, static_cast<float>(scale),
                               op + (b * heads + h * group) * dim, dim);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (one query per row)");
}
