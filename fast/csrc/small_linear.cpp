// Linears for a few rows in bfloat16 (a decode step of one or a few sequences): each weight row
// is streamed once from memory and dotted with every input row by AVX-512 BF16's pairwise dot
// (vdpbf16ps), float32 sums rounded once to bfloat16. At these sizes a linear is a read of its
// weights; oneDNN's general GEMM reads them slower. The dense [out, in] weight is used as it
// is: no packed copy. Only built where the compiler targets AVX-512 BF16 (``available``).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "checks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define STEP14_BF16_DOT 1
#include <immintrin.h>

#include "outputs.h"
#endif

namespace {

constexpr int64_t MAX_ROWS = 4;      // input rows one call takes (a decode step of <= 4 sequences)
constexpr int64_t ROWS_PER_TASK = 32;  // weight rows per parallel task
// How far ahead of the dots the weights are fetched, measured; for L1 only (NTA): a weight is
// read once; measured faster than a fetch into every cache level (T0).
constexpr int64_t PREFETCH_BYTES = 4096;

#ifdef STEP14_BF16_DOT
inline __mmask32 pair_mask(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << n) - 1); }
inline __m512bh load_pairs(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// sums[m] = dot(weight row w, x row m): the row read front to back (one stream the prefetcher
// follows), four partial sums per input row so the dots do not wait on each other.
template <int M>
inline void dot_row(const uint16_t* x, int64_t k, const uint16_t* w, float* sums) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 128 <= k; c += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + PREFETCH_BYTES, _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + PREFETCH_BYTES + 64, _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + PREFETCH_BYTES + 128, _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + PREFETCH_BYTES + 192, _MM_HINT_NTA);
    for (int j = 0; j < 4; ++j) {
      const __m512bh ws = load_pairs(w + c + 32 * j, 0xFFFFFFFFu);
      for (int m = 0; m < M; ++m)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], ws, load_pairs(x + m * k + c + 32 * j, 0xFFFFFFFFu));
    }
  }
  for (; c < k; c += 32) {
    const __mmask32 mask = pair_mask(k - c);
    const __m512bh ws = load_pairs(w + c, mask);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], ws, load_pairs(x + m * k + c, mask));
  }
  for (int m = 0; m < M; ++m)
    sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                 _mm512_add_ps(acc[m][2], acc[m][3])));
}

// sums [M, rows] for weight rows [first, first + rows).
template <int M>
void dot_block(const uint16_t* x, int64_t k, const uint16_t* w, int64_t first, int64_t rows, float* sums) {
  float part[M];
  for (int64_t r = 0; r < rows; ++r) {
    dot_row<M>(x, k, w + (first + r) * k, part);
    for (int m = 0; m < M; ++m) sums[m * rows + r] = part[m];
  }
}

void dot_block_any(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t first, int64_t rows,
                   float* sums) {
  switch (m) {
    case 1: return dot_block<1>(x, k, w, first, rows, sums);
    case 2: return dot_block<2>(x, k, w, first, rows, sums);
    case 3: return dot_block<3>(x, k, w, first, rows, sums);
    case 4: return dot_block<4>(x, k, w, first, rows, sums);
    default: TORCH_CHECK(false, "small_linear: ", m, " rows");  // the entry point refuses these first
  }
}
#endif

}  // namespace

bool small_linear_available() {
#ifdef STEP14_BF16_DOT
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 (M <= 4), weight [N, K] bfloat16 contiguous, bias [N] or undefined.
// silu_mul: the weight is a gate and an up projection stacked ([2I, K]); returns
// silu(x gate^T) * (x up^T) [M, I], else x weight^T + bias [M, N]. Float32 sums, one rounding.
at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        bool silu_mul) {
  TORCH_CHECK(small_linear_available(), "small_linear: built without AVX-512 BF16");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "small_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x_in.size(0) <= MAX_ROWS, "small_linear: at most ", MAX_ROWS, " rows");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              weight.is_contiguous() && x_in.device().is_cpu() && weight.device().is_cpu(),
              "small_linear: bfloat16 CPU tensors, contiguous weight");
  check_bias(bias, weight.size(0), "small_linear");
  TORCH_CHECK(!silu_mul || weight.size(0) % 2 == 0, "small_linear: silu_mul needs gate and up rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), width = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, x.options());
  const FloatBias bias_f(bias);
  const float* b = bias_f.data();
  if (m == 0 || width == 0) return out;  // nothing to read (an empty x has no storage)
#ifdef STEP14_BF16_DOT
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const auto dots = [&](int64_t first, int64_t rows, float* sums) { dot_block_any(xp, m, k, wp, first, rows, sums); };
  rows_over_threads(m, ROWS_PER_TASK, Finish{nullptr, b, width, silu_mul}, dots, op);
#endif
  return out;
}
