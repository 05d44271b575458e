// Linears of several input rows on 8-bit integer dot products, with weight rows in the lanes:
// Q4_0 (core/int4_format.py), Q8_0 (core/q8_0_format.py) and int8 with row scales
// (core/int8_format.py), on AVX-512 VNNI.
//
// block_linear (block_linear.cpp) reads a weight row's blocks across a vector's lanes, so every
// input row pays a float step per 64 weight bytes to scale its lanes' sums; at a decode step of
// many sequences that float work, not the weight's bytes, is the cost. Here int32 lane r of a
// vector holds weight row r's four bytes at one position, for 16 rows: one VPDPBUSD multiplies
// four weights of all 16 rows by four activations broadcast from memory, and a block of 32 costs
// each input row one float step for 16 weight rows, with no sum across lanes at the end.
//
//   Q4_0 is stored so (core/int4_format.py interleaves its rows by 16 at load, as llama.cpp
//   repacks Q4_0 for its CPU kernels): a group of 16 rows is read in place where one pass
//   covers every input row (up to 16: a decode step), else copied as it is into L1 first.
//   Q8_0 and int8 are stored row by row: each task copies 16 weight rows into a small buffer
//   that stays in L1, transposed (one 16 x 16 transpose of 32-bit words per 64 bytes of each
//   row); the copy is made once per call and used by every input row, so it pays from a few
//   rows up.
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
#include <type_traits>
#include <vector>

#include "balance.h"
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

// A task's copy of up to 16 weight rows in the lanes (rows past ``count`` zero), lane r = row r:
// for each block of 32 weights, its 64-byte vectors (Q8_0 and int8: eight, transposed from their
// rows by ``copy_rows``; a Q4_0 group: its four as stored, ``copy_stored``), and for Q4_0 / Q8_0
// the block's 16 weight scales in float32.
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
  static_assert(F != Format::q4_0, "Q4_0 is read as stored");
  c.w.resize(std::max<int64_t>(units * 16, nb * 8));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t u = 0; u < units; ++u) {
    const int64_t bytes = std::min<int64_t>(64, row_bytes - u * 64);
    if (next_count > 0) {
      const char* ahead = reinterpret_cast<const char*>(w + next * row_bytes + u * 64);
      for (int i = 0; i < next_count; ++i, ahead += row_bytes) prefetch_lines<_MM_HINT_T0>(ahead, 1);
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
      c.w[u * 16 + j] = _mm512_xor_si512(r[j], flip);
  }
  if constexpr (F != Format::int8) {
    c.scale.resize(((nb + 15) / 16) * 256);
    for (int64_t g = 0; g < nb; g += 16) {
      const __mmask16 m = tail_mask(nb - g);
      for (int i = 0; i < next_count; ++i)
        prefetch_lines<_MM_HINT_T0>(ws + (next + i) * nb + g, 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < count ? _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, ws + (first + i) * nb + g)))
                         : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(c.scale.data() + (g + j) * 16, r[j]);
    }
  }
}

// The high nibble of each byte: one GFNI affine transform (bit i <- bit i + 4) where the CPU has
// it, else a shift and a mask.
inline __m512i high_nibbles(__m512i v, __m512i nib) {
#ifdef __GFNI__
  return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#endif
}

// Where a pass reads its 16 weight rows: ``word(b, j)``, vector j of block b (lane r: row r's
// bytes), ``scales(b)``, the block's 16 weight scales in float32.
template <Format F>
struct FromCopy {  // a task's copy
  const Copy& c;
  static constexpr int V = F == Format::q4_0 ? 4 : 8;  // vectors per block
  __m512i word(int64_t b, int j) const { return _mm512_load_si512(c.w.data() + b * V + j); }
  __m512 scales(int64_t b) const { return _mm512_loadu_ps(c.scale.data() + b * 16); }
};

// How far ahead of the dots a Q4_0 group read in place is fetched (its scales: an eighth as far),
// measured; fetched for L1 only (NTA): a weight is read once.
constexpr int64_t Q4_PREFETCH_BYTES = 8192;

// A Q4_0 group as stored: ``rows`` rows (16, or fewer in the last group), block b's four words
// at w + b * 16 * rows (word j: 4 * rows bytes), its scales at s + b * rows. Full: 16 rows.
template <bool Full>
struct FromStored {
  const uint8_t* w;
  const at::Half* s;
  int64_t rows;
  __m512i word(int64_t b, int j) const {
    const uint8_t* at = w + (b * 4 + j) * rows * 4;
    if constexpr (Full) {
      _mm_prefetch(reinterpret_cast<const char*>(at) + Q4_PREFETCH_BYTES, _MM_HINT_NTA);
      return _mm512_loadu_si512(at);
    } else {
      return _mm512_maskz_loadu_epi8(rows == 16 ? ~0ULL : (1ULL << (4 * rows)) - 1, at);
    }
  }
  __m512 scales(int64_t b) const {
    if constexpr (Full) {
      _mm_prefetch(reinterpret_cast<const char*>(s + b * 16) + Q4_PREFETCH_BYTES / 8, _MM_HINT_NTA);
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b * 16)));
    } else {
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(rows), s + b * rows));
    }
  }
};

// A Q4_0 group as stored, copied as it is (16 lanes, rows past its own zero) for the passes of
// many input rows: one pass reads the group from memory, the others from L1.
template <bool Full>
void copy_stored(const FromStored<Full>& src, int64_t nb, Copy& c) {
  c.w.resize(nb * 4);
  c.scale.resize(nb * 16);
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 4; ++j) c.w[b * 4 + j] = src.word(b, j);
    _mm512_storeu_ps(c.scale.data() + b * 16, src.scales(b));
  }
}

// 16 weight rows (``src``) against M input rows from ``first``: sums[m] = their dots with row m.
template <Format F, int M, typename Source>
void copy_dots(const Source& src, const Acts& a, int64_t first, __m512* sums) {
  const int64_t nb = a.blocks;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 1  // one block's weights and M sums fill the registers: unrolled, the sums spill
  for (int64_t b = 0; b < nb; ++b) {
    // w[j] meets the block's activation word j (Q4_0: j < 4 low nibbles, elements 4j..4j+3;
    // j >= 4 high nibbles, elements 16 + 4(j - 4)...; Q8_0 / int8: elements 4j..4j+3).
    __m512i w[8];
    if constexpr (F == Format::q4_0) {
      for (int j = 0; j < 4; ++j) {
        const __m512i x = src.word(b, j);
        w[j] = _mm512_and_si512(x, nib);
        w[j + 4] = high_nibbles(x, nib);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = src.word(b, j);
    }
    __m512 ws;
    if constexpr (F != Format::int8) ws = src.scales(b);
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

template <Format F, typename Source>
void copy_dots_any(const Source& src, const Acts& a, int64_t first, int64_t m, __m512* sums) {
  switch (m) {
#define STEP14_CASE(n) \
  case n:              \
    return copy_dots<F, n>(src, a, first, sums);
    STEP14_CASE(1) STEP14_CASE(2) STEP14_CASE(3) STEP14_CASE(4) STEP14_CASE(5) STEP14_CASE(6) STEP14_CASE(7)
    STEP14_CASE(8) STEP14_CASE(9) STEP14_CASE(10) STEP14_CASE(11) STEP14_CASE(12) STEP14_CASE(13)
    STEP14_CASE(14) STEP14_CASE(15) STEP14_CASE(16)
#undef STEP14_CASE
  }
  TORCH_CHECK(false, "lane_linear: a pass of ", m, " rows");  // passes hold 1..MAX_M
}

// The outputs of weight rows [row0, row0 + count) (a group; silu_mul: the up rows ``up`` beside
// the gate rows ``gate``) for every input row, a pass of up to MAX_M input rows at a time.
template <Format F, typename Source, typename T>
void group_out(const Source& gate, const Source* up, const Acts& a, int64_t m, int64_t row0, int64_t count,
               int64_t width, const float* rs, const float* bias, T* out, __m512* g, __m512* u) {
  const __mmask16 mask = tail_mask(count);
  auto finish = [&](__m512 v, int64_t r0) {  // row scales and bias of rows r0...
    if constexpr (F == Format::int8) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, rs + r0));
    return bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + r0)) : v;
  };
  for (int64_t first = 0; first < m; first += MAX_M) {
    const int64_t pass = std::min(MAX_M, m - first);
    copy_dots_any<F>(gate, a, first, pass, g);
    if (up) copy_dots_any<F>(*up, a, first, pass, u);
    for (int64_t i = 0; i < pass; ++i) {
      const __m512 y = finish(g[i], row0);
      store16(out + (first + i) * width + row0, up ? silu_mul16(y, finish(u[i], width + row0)) : y, mask);
    }
  }
}

template <Format F, typename T>
void lane_linear_into(const Acts& a, int64_t m, const at::Tensor& weight, const at::Tensor& scale, const float* bias,
                      bool silu_mul, T* out, int64_t width) {
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const at::Half* ws = F == Format::int8 ? nullptr : scale.data_ptr<at::Half>();
  const float* rs = F == Format::int8 ? scale.data_ptr<float>() : nullptr;
  const int64_t row_bytes = weight.size(1), nb = a.blocks, groups = (width + LANES - 1) / LANES;
  balanced_for(groups, [&](Claims& claims) {
    std::vector<__m512> g(MAX_M), u(MAX_M);
    Copy gate, up;
    for (int64_t grp; claims.next(grp);) {
      const int64_t row0 = grp * LANES, count = std::min(LANES, width - row0);
      if constexpr (F == Format::q4_0) {  // group grp's rows start at row0's bytes
        auto run = [&](auto full) {
          using Stored = FromStored<decltype(full)::value>;
          const Stored gs{w + row0 * row_bytes, ws + row0 * nb, count};
          const Stored us{w + (width + row0) * row_bytes, ws + (width + row0) * nb, count};
          if (m <= MAX_M) {  // one pass: read in place
            group_out<F>(gs, silu_mul ? &us : nullptr, a, m, row0, count, width, rs, bias, out, g.data(), u.data());
            return;
          }
          copy_stored(gs, nb, gate);
          if (silu_mul) copy_stored(us, nb, up);
          const FromCopy<F> gc{gate}, uc{up};
          group_out<F>(gc, silu_mul ? &uc : nullptr, a, m, row0, count, width, rs, bias, out, g.data(), u.data());
        };
        if (count == LANES) run(std::true_type{});
        else run(std::false_type{});
      } else {
        // the group after it, as the owner of a range claims them
        const int64_t next_count = grp + 1 < groups ? std::min(LANES, width - row0 - LANES) : 0;
        copy_rows<F>(w, ws, row_bytes, nb, row0, count, silu_mul ? width + row0 : row0 + LANES,
                     silu_mul ? count : next_count, gate);
        if (silu_mul) copy_rows<F>(w, ws, row_bytes, nb, width + row0, count, row0 + LANES, next_count, up);
        const FromCopy<F> gs{gate}, us{up};
        group_out<F>(gs, silu_mul ? &us : nullptr, a, m, row0, count, width, rs, bias, out, g.data(), u.data());
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
  TORCH_CHECK(!silu_mul || f != Format::q4_0 || weight.size(0) % (2 * LANES) == 0,
              "lane_linear: silu_mul on Q4_0 needs the gate's rows in whole groups of ", LANES,
              " (the up rows start a group), got ", weight.size(0) / 2);
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
