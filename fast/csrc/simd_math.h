// Vector math the kernels share (AVX-512, float32, 16 lanes); included where the build targets AVX-512.
#pragma once
#include <immintrin.h>

#include <cstdint>

// Before a loop over a kernel's register array (accumulators [R][M], R and M template constants):
// unrolled at once, so the array becomes registers. Left to the later unroller, GCC 12 kept
// such an array on the stack and stored every accumulator back each step of the loop around it.
#define STEP14_UNROLL _Pragma("GCC unroll 16")

// The first n of 16 lanes (none for n <= 0).
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// 16 bfloat16 values (the mask's lanes; the rest 0) as float32: a bfloat16 is a float32's top half.
inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// exp(x) for x <= 0 (a softmax's scores minus their maximum; silu's -|g|): Cephes' expf polynomial, 2^n by scalef.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Fetches the cache lines of [p, p + bytes) ahead of use (Hint: an _MM_HINT_*). The empty
// volatile asm keeps the loop: GCC counts a prefetch as no effect and may delete a finite loop
// that only prefetches.
template <int Hint>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
    _mm_prefetch(c + i, static_cast<decltype(_MM_HINT_NTA)>(Hint));
    asm volatile("");
  }
}
