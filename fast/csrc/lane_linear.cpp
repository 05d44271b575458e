// Linears of several input rows on 8-bit integer dot products, with weight rows in the lanes:
// Q4_0 (core/int4_format.py), Q8_0 (core/q8_0_format.py) and int8 with row scales
// (core/int8_format.py), on AVX-512 VNNI.
//
// block_linear (block_linear.cpp) reads a weight row's blocks across a vector's lanes, so every
// input row pays a float step per 64 weight bytes to scale its lanes' sums; at a decode step of
// many sequences that float work, not the weight's bytes, is the cost. Here each task copies 16
// weight rows into a small buffer that stays in L1, transposed so that int32 lane r holds row
// r's four bytes at each position (one 16 x 16 transpose of 32-bit words per 64 bytes of each
// row): then one VPDPBUSD multiplies four weights of all 16 rows by four activations broadcast
// from memory, and a block of 32 costs each input row one float step for 16 weight rows. The
// copy is made once per call and used by every input row, so it pays from a few rows up.
//
//   The activations are quantized per block of 32 to int8 as block_linear quantizes them
//   (scale max|x| / 127, round to nearest even); the weight is VPDPBUSD's unsigned operand (a
//   Q4_0 nibble is value + 8; Q8_0's and int8's bytes get their sign bit flipped in the copy,
//   value + 128), so each block's integer sum starts at minus that offset times the block's
//   activation sum and comes out exact. Q4_0 / Q8_0: sum * weight scale * activation scale,
//   summed in float32; int8: sum * activation scale, times the row's scale at the end. The
//   result is rounded once to the input's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "checks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define STEP14_LANE_DOT 1
#include <immintrin.h>

#include "outputs.h"
#include "simd_math.h"
#endif

namespace {

constexpr int64_t BLOCK = 32;  // activations quantized per 32 (a Q4_0 / Q8_0 block)
constexpr int64_t LANES = 16;  // weight rows per copy, one per int32 lane
constexpr int64_t MAX_M = 16;  // input rows per pass over a copy (their sums stay in registers)

// The weight's format (lane_linear's ``format``): what a stored row is.
enum class Format { q4_0 = 4, q8_0 = 8, int8 = 1 };

Format format_of(int64_t code) {
  TORCH_CHECK(code == 4 || code == 8 || code == 1,
              "lane_linear: format 4 (Q4_0), 8 (Q8_0) or 1 (int8, row scales), got ", code);
  return static_cast<Format>(code);
}

#ifdef STEP14_LANE_DOT

// The quantized input rows: per row and block, 32 int8 values (zeros past K), the block's
// starting sum (-offset * its values' sum) and its scale.
struct Acts {
  int64_t blocks = 0;
  std::vector<int8_t> q;        // [M, blocks, 32]
  std::vector<int32_t> start;   // [M, blocks]
  std::vector<float> scale;     // [M, blocks]
};

inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load16(const at::BFloat16* x, __mmask16 m) { return load_bf16(reinterpret_cast<const uint16_t*>(x), m); }

template <typename T>
Acts quantize(const T* x, int64_t m, int64_t k, int32_t offset) {
  Acts a;
  a.blocks = (k + BLOCK - 1) / BLOCK;
  a.q.assign(m * a.blocks * BLOCK, 0);
  a.start.assign(m * a.blocks, 0);
  a.scale.assign(m * a.blocks, 0.f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t c = b * BLOCK;
      const __m512 lo = load16(x + i * k + c, tail_mask(k - c)), hi = load16(x + i * k + c + 16, tail_mask(k - c - 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      int8_t* q = a.q.data() + (i * a.blocks + b) * BLOCK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
      a.start[i * a.blocks + b] = -offset * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      a.scale[i * a.blocks + b] = amax / 127.f;
    }
  return a;
}

// 16 vectors of 16 32-bit words, transposed in place: word j of vector i goes to word i of vector j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// The copy of up to 16 weight rows (rows past ``count`` zero), lane r = row r: for each block
// of 32 weights, its 64-byte vectors (Q4_0: 4, each word four bytes of the block's 16; Q8_0 and
// int8: 8), and for Q4_0 / Q8_0 the block's 16 weight scales in float32.
struct Copy {
  std::vector<__m512i> w;   // [blocks * vectors per block]
  std::vector<float> scale; // [blocks, 16]
};

// ``next``, ``next_count``: the rows the following copy will read, fetched meanwhile (the
// hardware prefetcher does not learn 16 short streams before they end).
template <Format F>
void copy_rows(const uint8_t* w, const at::Half* ws, int64_t row_bytes, int64_t nb, int64_t first, int64_t count,
               int64_t next, int64_t next_count, Copy& c) {
  const int64_t units = (row_bytes + 63) / 64;
  c.w.resize(std::max<int64_t>(units * 16, nb * (F == Format::q4_0 ? 4 : 8)));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t u = 0; u < units; ++u) {
    const int64_t bytes = std::min<int64_t>(64, row_bytes - u * 64);
    if (next_count > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + next * row_bytes + u * 64);
      for (int i = 0; i < next_count; ++i, ahead += row_bytes) _mm_prefetch(ahead, _MM_HINT_T0);
    }
    __m512i r[16];
    const uint8_t* src = w + first * row_bytes + u * 64;
    if (count == 16 && bytes == 64) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i, src += row_bytes) r[i] = _mm512_loadu_si512(src);
    } else {
      const __mmask64 mask = bytes == 64 ? ~0ULL : (1ULL << bytes) - 1;
      for (int i = 0; i < 16; ++i, src += row_bytes)
        r[i] = i < count ? _mm512_maskz_loadu_epi8(mask, src) : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int j = 0; j < 16; ++j)
      c.w[u * 16 + j] = F == Format::q4_0 ? r[j] : _mm512_xor_si512(r[j], flip);
  }
  if constexpr (F != Format::int8) {
    c.scale.resize(((nb + 15) / 16) * 256);
    for (int64_t g = 0; g < nb; g += 16) {
      const __mmask16 m = tail_mask(nb - g);
      for (int i = 0; i < next_count; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(ws + (next + i) * nb + g), _MM_HINT_T0);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < count ? _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, ws + (first + i) * nb + g)))
                         : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(c.scale.data() + (g + j) * 16, r[j]);
    }
  }
}

// The copy against M input rows from ``first``: sums[m] = 16 weight rows' dots with row m.
template <Format F, int M>
void copy_dots(const Copy& c, const Acts& a, int64_t first, __m512* sums) {
  constexpr int V = F == Format::q4_0 ? 4 : 8;  // vectors per block in the copy
  const int64_t nb = a.blocks;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 1  // one block's weights and M sums fill the registers: unrolled, the sums spill
  for (int64_t b = 0; b < nb; ++b) {
    // w[j] meets the block's activation word j (Q4_0: j < 4 low nibbles, elements 4j..4j+3;
    // j >= 4 high nibbles, elements 16 + 4(j - 4)...; Q8_0 / int8: elements 4j..4j+3).
    __m512i w[8];
    const __m512i* v = c.w.data() + b * V;
    if constexpr (F == Format::q4_0) {
      for (int j = 0; j < 4; ++j) {
        const __m512i x = _mm512_load_si512(v + j);
        w[j] = _mm512_and_si512(x, nib);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_load_si512(v + j);
    }
    __m512 ws;
    if constexpr (F != Format::int8) ws = _mm512_loadu_ps(c.scale.data() + b * 16);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (first + m) * nb + b;
      const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + at * BLOCK);
      __m512i s0 = _mm512_set1_epi32(a.start[at]), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(q[j]));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(q[j + 1]));
      }
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      const __m512 as = _mm512_set1_ps(a.scale[at]);
      acc[m] = _mm512_fmadd_ps(sum, F == Format::int8 ? as : _mm512_mul_ps(ws, as), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) sums[m] = acc[m];
}

template <Format F>
void copy_dots_any(const Copy& c, const Acts& a, int64_t first, int64_t m, __m512* sums) {
  switch (m) {
#define STEP14_CASE(n) \
  case n:              \
    return copy_dots<F, n>(c, a, first, sums);
    STEP14_CASE(1) STEP14_CASE(2) STEP14_CASE(3) STEP14_CASE(4) STEP14_CASE(5) STEP14_CASE(6) STEP14_CASE(7)
    STEP14_CASE(8) STEP14_CASE(9) STEP14_CASE(10) STEP14_CASE(11) STEP14_CASE(12) STEP14_CASE(13)
    STEP14_CASE(14) STEP14_CASE(15) STEP14_CASE(16)
#undef STEP14_CASE
  }
  TORCH_CHECK(false, "lane_linear: a pass of ", m, " rows");  // passes hold 1..MAX_M
}

template <Format F, typename T>
void lane_linear_into(const Acts& a, int64_t m, const at::Tensor& weight, const at::Tensor& scale, const float* bias,
                      bool silu_mul, T* out, int64_t width) {
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const at::Half* ws = F == Format::int8 ? nullptr : scale.data_ptr<at::Half>();
  const float* rs = F == Format::int8 ? scale.data_ptr<float>() : nullptr;
  const int64_t row_bytes = weight.size(1), nb = a.blocks, groups = (width + LANES - 1) / LANES;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Copy gate, up;
    std::vector<__m512> g(MAX_M), u(MAX_M);
    for (int64_t grp = begin; grp < end; ++grp) {
      const int64_t row0 = grp * LANES, count = std::min(LANES, width - row0);
      const __mmask16 mask = tail_mask(count);
      const int64_t next_count = grp + 1 < end ? std::min(LANES, width - row0 - LANES) : 0;
      copy_rows<F>(w, ws, row_bytes, nb, row0, count, silu_mul ? width + row0 : row0 + LANES,
                   silu_mul ? count : next_count, gate);
      if (silu_mul) copy_rows<F>(w, ws, row_bytes, nb, width + row0, count, row0 + LANES, next_count, up);
      auto finish = [&](__m512 v, int64_t r0) {  // row scales and bias of rows r0...
        if constexpr (F == Format::int8) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, rs + r0));
        return bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + r0)) : v;
      };
      for (int64_t first = 0; first < m; first += MAX_M) {
        const int64_t pass = std::min(MAX_M, m - first);
        copy_dots_any<F>(gate, a, first, pass, g.data());
        if (silu_mul) copy_dots_any<F>(up, a, first, pass, u.data());
        for (int64_t i = 0; i < pass; ++i) {
          const __m512 y = finish(g[i], row0);
          store16(out + (first + i) * width + row0, silu_mul ? silu_mul16(y, finish(u[i], width + row0)) : y, mask);
        }
      }
    }
  });
}

#endif  // STEP14_LANE_DOT

void check_operands(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, Format f) {
  check_block_input(x, "lane_linear");
  const int64_t k = x.size(1);
  if (f == Format::int8) {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu() &&
                    weight.scalar_type() == at::kChar,
                "lane_linear: a contiguous int8 CPU weight [N, K], got ", weight.sizes(), " ", weight.scalar_type());
    TORCH_CHECK(weight.size(1) == k, "lane_linear: x's K = ", k, " but the int8 weight has ", weight.size(1),
                " columns");
    check_row_scales(scale, weight.size(0), "lane_linear");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(),
                "lane_linear: contiguous float32 row scales, got ", scale.scalar_type());
    return;
  }
  check_block_weight(weight, scale, f == Format::q4_0, k, "lane_linear");
}

}  // namespace

bool lane_linear_available() {
#ifdef STEP14_LANE_DOT
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 or float32 (any M); ``format`` 4: Q4_0 weight uint8 [N, K / 2] with float16
// block scales [N, K / 32]; 8: Q8_0 int8 [N, K], the same scales; 1: int8 [N, K] with float32
// row scales [N]. bias [N] or undefined. silu_mul: the weight is a gate and an up projection
// stacked ([2I, ...]); returns silu(x gate^T) * (x up^T) [M, I], else x weight^T + bias [M, N],
// in x's dtype.
at::Tensor lane_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t format, bool silu_mul) {
  TORCH_CHECK(lane_linear_available(), "lane_linear: built without AVX-512 VNNI");
  const Format f = format_of(format);
  check_operands(x_in, weight, scale, f);
  check_bias(bias, weight.size(0), "lane_linear");
  TORCH_CHECK(!silu_mul || weight.size(0) % 2 == 0, "lane_linear: silu_mul needs gate and up rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), width = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, x.options());
  if (m == 0 || width == 0) return out;
#ifdef STEP14_LANE_DOT
  const FloatBias bias_f(bias);
  const float* b = bias_f.data();
  const at::Tensor s = f == Format::int8 ? scale.view({-1}) : scale;
  auto run = [&](auto* xp, auto* op) {
    const Acts a = quantize(xp, m, k, f == Format::q4_0 ? 8 : 128);
    if (f == Format::q4_0) lane_linear_into<Format::q4_0>(a, m, weight, s, b, silu_mul, op, width);
    else if (f == Format::q8_0) lane_linear_into<Format::q8_0>(a, m, weight, s, b, silu_mul, op, width);
    else lane_linear_into<Format::int8>(a, m, weight, s, b, silu_mul, op, width);
  };
  if (x.scalar_type() == at::kBFloat16)
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else
    run(x.data_ptr<float>(), out.data_ptr<float>());
#endif
  return out;
}
