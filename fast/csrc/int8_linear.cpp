// Linears on 8-bit weights (int8, one float32 scale per output row) with exact activations: each
// int8 weight row is streamed once, widened to float32 in registers (exact: |q| <= 127) and
// fused-multiply-added with every input row (in float32); the sums are multiplied by the row's
// scale and rounded once to the input's dtype. Up to eight weight rows share each input load.
// A row's sum is computed the same way at every row count (MAX_ROWS input rows at a time, over
// tiles of weight rows that stay in cache), so its bits do not depend on the rows beside it.
// Also the dequantized weight, for the matmul path of many bfloat16 rows. Built where the
// compiler targets AVX-512 (``int8_linear_available``).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "checks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STEP14_INT8_DOT 1
#include <immintrin.h>

#include "outputs.h"
#include "simd_math.h"
#endif

namespace {

constexpr int64_t MAX_ROWS = 8;        // input rows one call takes
constexpr int64_t ROWS_PER_TASK = 32;  // weight rows per parallel task
// How far ahead of the dots the weights are fetched, measured; for L1 only (NTA), as in
// small_linear.cpp.
constexpr int64_t PREFETCH_BYTES = 8192;

#ifdef STEP14_INT8_DOT
// Widening is the cost at these row counts: two cheap steps per 16 weights, done once per
// weight whatever the number of input rows.

inline __m512 widen16(const int8_t* w, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w)));
}

// R weight rows against M input rows: each 16 weights of a row are widened once and used by
// every input row; each input load is used by R weight rows. R * M sums stay in registers: the
// loops are unrolled at once (STEP14_UNROLL); left to GCC the sums were stored back every 16
// weights, and a prompt's float32 int8 linears ran at half the speed.
template <int M, int R>
inline void dot_block_many(const float* x, int64_t k, const int8_t* const* w, float* sums, int64_t stride, int64_t ahead) {
  __m512 acc[R][M];
  STEP14_UNROLL for (int r = 0; r < R; ++r)
    STEP14_UNROLL for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const auto step = [&](int64_t c, __mmask16 mask) {  // 16 weights of each row, every input row
    __m512 ws[R];
    STEP14_UNROLL for (int r = 0; r < R; ++r) ws[r] = widen16(w[r] + c, mask);
    STEP14_UNROLL for (int m = 0; m < M; ++m) {
      const __m512 xs = _mm512_maskz_loadu_ps(mask, x + m * k + c);
      STEP14_UNROLL for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(ws[r], xs, acc[r][m]);
    }
  };
  int64_t c = 0;
  for (; c + 64 <= k; c += 64) {  // a cache line of each row, fetched ahead
    STEP14_UNROLL for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + c + ahead), _MM_HINT_NTA);
    STEP14_UNROLL for (int u = 0; u < 4; ++u) step(c + 16 * u, 0xFFFF);
  }
  for (; c < k; c += 16) step(c, tail_mask(k - c));
  STEP14_UNROLL for (int r = 0; r < R; ++r)
    STEP14_UNROLL for (int m = 0; m < M; ++m) sums[m * stride + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// One input row keeps the loop as first written: forced into registers like the rows above,
// it ran batch-1 int8 decode at 0.78-0.85x (A/B, AMD EPYC, 1 thread) -- measured, not understood.
template <int M, int R>
inline void dot_block(const float* x, int64_t k, const int8_t* const* w, float* sums, int64_t stride, int64_t ahead) {
  if constexpr (M > 1) {
    dot_block_many<M, R>(x, k, w, sums, stride, ahead);
    return;
  } else {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
      if ((c & 63) == 0)
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + c + ahead), _MM_HINT_NTA);
      __m512 ws[R];
      for (int r = 0; r < R; ++r) ws[r] = widen16(w[r] + c, 0xFFFFu);
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_loadu_ps(x + m * k + c);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(ws[r], xs, acc[r][m]);
      }
    }
    if (c < k) {
      const __mmask16 mask = tail_mask(k - c);
      __m512 ws[R];
      for (int r = 0; r < R; ++r) ws[r] = widen16(w[r] + c, mask);
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_maskz_loadu_ps(mask, x + m * k + c);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(ws[r], xs, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) sums[m * stride + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

// sums [M, rows] (row stride ``stride``) for weight rows [first, first + rows), R at a time (the
// last block repeats its last row where fewer are left; those sums are dropped).
template <int M, int R>
void dot_rows_by(const float* x, int64_t k, const int8_t* w, int64_t first, int64_t rows, float* sums,
                 int64_t stride) {
  float part[M * R];
  // Each row fetches a whole number of blocks ahead (twice PREFETCH_BYTES at least, measured):
  // R rows are read side by side, so a fixed distance ahead of one row can land in a row the
  // block is reading now, and nothing is fetched ahead at all.
  const int64_t ahead = (2 * PREFETCH_BYTES + R * k - 1) / (R * k) * (R * k);
  for (int64_t r = 0; r < rows; r += R) {
    const int8_t* block[R];
    for (int j = 0; j < R; ++j) block[j] = w + (first + std::min(r + j, rows - 1)) * k;
    dot_block<M, R>(x, k, block, part, R, ahead);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < R && r + j < rows; ++j) sums[m * stride + r + j] = part[m * R + j];
  }
}

// Up to MAX_ROWS input rows: a row's sum is one fma chain per lane, then one reduction, at
// every row count -- so a row's result does not depend on the rows beside it.
void dot_few_rows(const float* x, int64_t m, int64_t k, const int8_t* w, int64_t first, int64_t rows, float* sums,
                  int64_t stride) {
  switch (m) {
    case 1: return dot_rows_by<1, 8>(x, k, w, first, rows, sums, stride);
    case 2: return dot_rows_by<2, 4>(x, k, w, first, rows, sums, stride);
    case 3: return dot_rows_by<3, 4>(x, k, w, first, rows, sums, stride);
    case 4: return dot_rows_by<4, 4>(x, k, w, first, rows, sums, stride);
    case 5: return dot_rows_by<5, 2>(x, k, w, first, rows, sums, stride);
    case 6: return dot_rows_by<6, 2>(x, k, w, first, rows, sums, stride);
    case 7: return dot_rows_by<7, 2>(x, k, w, first, rows, sums, stride);
    case 8: return dot_rows_by<8, 2>(x, k, w, first, rows, sums, stride);
    default: TORCH_CHECK(false, "int8_linear: ", m, " rows at once");
  }
}

// sums [m, rows] (unscaled) for weight rows [first, first + rows). More than MAX_ROWS input rows
// go MAX_ROWS at a time over a tile of TILE weight rows, which stays in cache meanwhile: the
// weight is read from memory once.
constexpr int64_t TILE = 32;

void dot_rows(const float* x, int64_t m, int64_t k, const int8_t* w, int64_t first, int64_t rows, float* sums) {
  if (m <= MAX_ROWS) return dot_few_rows(x, m, k, w, first, rows, sums, rows);
  for (int64_t t = 0; t < rows; t += TILE)
    for (int64_t i = 0; i < m; i += MAX_ROWS)
      dot_few_rows(x + i * k, std::min(MAX_ROWS, m - i), k, w, first + t, std::min(TILE, rows - t),
                   sums + i * rows + t, rows);
}
#endif

}  // namespace

bool int8_linear_available() {
#ifdef STEP14_INT8_DOT
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 or float32 (any M; MAX_ROWS at a time), weight [N, K] int8 contiguous, scale [N], bias [N]
// or undefined. Row n of the weight is weight[n] * scale[n]. silu_mul: the weight is a gate and
// an up projection stacked ([2I, K]); returns silu(x gate^T) * (x up^T) [M, I], else
// x weight^T + bias [M, N], in x's dtype. Float32 sums, one rounding.
at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale_in,
                       const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(int8_linear_available(), "int8_linear: built without AVX-512");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "int8_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK((x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat) &&
                  weight.scalar_type() == at::kChar && weight.is_contiguous() && x_in.device().is_cpu() &&
                  weight.device().is_cpu(),
              "int8_linear: bfloat16 or float32 input, contiguous int8 weight, CPU tensors");
  check_row_scales(scale_in, weight.size(0), "int8_linear");
  check_bias(bias, weight.size(0), "int8_linear");
  TORCH_CHECK(!silu_mul || weight.size(0) % 2 == 0, "int8_linear: silu_mul needs gate and up rows");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), width = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, x_in.options());  // float32 sums, rounded once to x's dtype
  const FloatBias bias_f(bias);
  const float* b = bias_f.data();
  if (m == 0 || width == 0) return out;  // nothing to read
#ifdef STEP14_INT8_DOT
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  const Finish finish{s, b, width, silu_mul};
  const auto dots = [&](int64_t first, int64_t rows, float* sums) { dot_rows(xp, m, k, wp, first, rows, sums); };
  if (out.scalar_type() == at::kFloat) rows_over_threads(m, ROWS_PER_TASK, finish, dots, out.data_ptr<float>());
  else rows_over_threads(m, ROWS_PER_TASK, finish, dots, out.data_ptr<at::BFloat16>());
#endif
  return out;
}

namespace {

// One row of int8_dequantize: value * scale in float32, then rounded once to the output dtype.
void dequantize_row(const int8_t* row, float scale, int64_t k, at::Tensor& out, int64_t r) {
  const bool to_float = out.scalar_type() == at::kFloat;
  float* of = to_float ? out.data_ptr<float>() + r * k : nullptr;
  at::BFloat16* ob = to_float ? nullptr : out.data_ptr<at::BFloat16>() + r * k;
  int64_t c = 0;
#ifdef STEP14_INT8_DOT
  const __m512 s = _mm512_set1_ps(scale);
  for (; c + 16 <= k; c += 16) {
    const __m512 v = _mm512_mul_ps(widen16(row + c, 0xFFFFu), s);
    if (to_float) {
      _mm512_storeu_ps(of + c, v);
      continue;
    }
#ifdef __AVX512BF16__  // round to nearest even, as the scalar conversion below
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + c), (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int j = 0; j < 16; ++j) ob[c + j] = static_cast<at::BFloat16>(tmp[j]);
#endif
  }
#endif
  for (; c < k; ++c) {
    const float v = static_cast<float>(row[c]) * scale;
    if (to_float) of[c] = v; else ob[c] = static_cast<at::BFloat16>(v);
  }
}

}  // namespace

// weight [N, K] int8 times scale [N] as a [N, K] tensor of ``dtype`` (the matmul path for
// many rows): each value rounded once, as model.py's Int8Linear.dequantized rounds it.
at::Tensor int8_dequantize(const at::Tensor& weight, const at::Tensor& scale_in, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.device().is_cpu(), "int8_dequantize: a contiguous int8 CPU weight [N, K]");
  check_row_scales(scale_in, weight.size(0), "int8_dequantize");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "int8_dequantize: to bfloat16 or float32");
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({n, k}, weight.options().dtype(dtype));
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row(wp + r * k, s[r], k, out, r);
  });
  return out;
}
