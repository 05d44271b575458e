// A linear kernel's last step, shared: float32 sums of a task's weight rows to output values,
// 16 rows at a time -- row scale, bias, silu(gate) * up, one rounding to the output's dtype.
// Done one value at a time it cost a decode token as much as a few weight rows' reads (a
// scalar exp and a scalar bfloat16 rounding per output). Included where the build targets
// AVX-512. Beside it, how a few-row kernel shares its weight rows out over the threads
// (``rows_over_threads``, by balance.h).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "balance.h"
#include "simd_math.h"

// 16 float32 values to out's dtype (the mask's lanes), rounded once to nearest even.
inline void store16(float* out, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(out, m, v); }
inline void store16(at::BFloat16* out, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) out[i] = static_cast<at::BFloat16>(f[i]);
#endif
}

// silu(g) * u, 16 lanes: g * sigmoid(g), sigmoid from e = exp(-|g|) (1 / (1 + e), or e / (1 + e)
// for g < 0), so exp never overflows.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

// What a task's sums become: for weight rows [begin, begin + rows) of ``width`` outputs,
// y = sum * scale[row] + bias[row] (scale, bias: per weight row, or null); with an up half
// (silu_mul: rows width + begin...), y = silu(y_gate) * y_up.
struct Finish {
  const float* scale;  // row scales [2 * width or width], or null
  const float* bias;   // [2 * width or width], or null
  int64_t width;
  bool silu_mul;

  __m512 at(__m512 v, int64_t row, __mmask16 m) const {
    if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, scale + row));
    return bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + row)) : v;
  }

  // gate / up: [m, rows] sums (up unread without silu_mul); out [m, width].
  template <typename T>
  void rows(const float* gate, const float* up, int64_t m, int64_t begin, int64_t rows, T* out) const {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = 0; r < rows; r += 16) {
        const __mmask16 mask = tail_mask(rows - r);
        __m512 y = at(_mm512_maskz_loadu_ps(mask, gate + i * rows + r), begin + r, mask);
        if (silu_mul) y = silu_mul16(y, at(_mm512_maskz_loadu_ps(mask, up + i * rows + r), width + begin + r, mask));
        store16(out + i * width + begin + r, y, mask);
      }
  }
};

// A few-row linear's weight rows over the threads, ``grain`` rows at least per task:
// dots(first, rows, sums) fills sums [m, rows] for weight rows [first, first + rows); the gate
// rows, then (silu_mul) the up rows, then the last step into out [m, width].
template <typename Dots, typename T>
void rows_over_threads(int64_t m, int64_t grain, const Finish& finish, const Dots& dots, T* out) {
  struct Sums {
    std::vector<float> gate, up;
  };
  const auto setup = [&] { return Sums{std::vector<float>(m * grain), std::vector<float>(finish.silu_mul ? m * grain : 0)}; };
  balanced_chunks(finish.width, grain, setup, [&](Sums& s, int64_t begin, int64_t end) {
    const int64_t rows = end - begin;
    dots(begin, rows, s.gate.data());
    if (finish.silu_mul) dots(finish.width + begin, rows, s.up.data());
    finish.rows(s.gate.data(), s.up.data(), m, begin, rows, out);
  });
}
