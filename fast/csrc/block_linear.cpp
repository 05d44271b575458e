// Linears on llama.cpp's block formats (core/int4_format.py: Q4_0; core/q8_0_format.py: Q8_0):
// blocks of 32 inputs, one float16 scale each.
//
// block_linear: the activations are quantized per block of 32 to int8 (scale max|x| / 127, round
// to nearest even, as llama.cpp quantizes them for its Q4_0 / Q8_0 dot products), then every
// weight is multiplied with AVX-512 VNNI's integer dot product (VPDPBUSD: unsigned bytes times
// signed bytes, four per 32-bit lane). Each block's integer sum is multiplied by the weight's and
// the activation's scales and summed in float32; the result is rounded once to the input's dtype.
//
//   Q4_0 is stored with its rows interleaved by 16 (core/int4_format.py), so its linears, at any
//   row count, are lane_linear's (lane_linear.cpp: 16 weight rows in the lanes, read in place);
//   block_linear hands them over. Q8_0 is stored as GGUF lays it out, row by row: here each
//   weight row is read once across a vector's lanes, for any number of input rows: eight input
//   rows share each weight load, and a task's weight rows stay in cache while every group of
//   eight passes over them. The weight is VPDPBUSD's unsigned operand, its bytes with the sign
//   bit flipped (value + 128); each int32 lane starts at -128 times the sum of its own
//   activations, so the integer dot products come out exact, with no correction afterwards.
//
// A 64-byte load is a unit: two Q8_0 blocks and the 64 activation bytes they meet. A last,
// partial unit is read with a mask. The weight is prefetched ahead of the dots.
//
// Past a row, each row's float step per unit is the cost: lane_linear.cpp computes those.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define STEP14_BLOCK_DOT 1
#include <immintrin.h>

#include "outputs.h"
#include "simd_math.h"
#endif

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t GROUP = 8;           // input rows that share each weight load
constexpr int64_t ROWS_PER_TASK = 16;  // weight rows per parallel task
enum class Kind { q4_0, q8_0 };

// How far ahead of the dots the weight is fetched (its scales: as far in blocks), measured. The
// hardware prefetcher alone leaves the loads waiting on memory between the dots; fetched for
// L1 only (NTA): a weight is read once; measured faster than a fetch into every level (T0).
constexpr int64_t PREFETCH_BYTES = 8192;

// What a block format's entry point checks, whatever it computes.
void check_weight(const at::Tensor& weight, const at::Tensor& scale, Kind kind, int64_t k, const char* name) {
  check_block_weight(weight, scale, kind == Kind::q4_0, k, name);
}

Kind kind_of(int64_t bits, const char* name) {
  TORCH_CHECK(bits == 4 || bits == 8, name, ": bits 4 (Q4_0) or 8 (Q8_0), got ", bits);
  return bits == 4 ? Kind::q4_0 : Kind::q8_0;
}

#ifdef STEP14_BLOCK_DOT

// The quantized input rows, per row in units of 64 (the last padded with zeros): the int8
// values, each lane's starting sum (-128 * the sum of its four activations) and each lane's
// activation scale (its block's). Int32 lane l of a unit's dot product sums four products of
// block l / 8 of the unit.
struct Quantized {
  int64_t blocks, units, act;  // act: activation bytes per row
  std::vector<int8_t> q;       // [M, units * 64]
  std::vector<int32_t> start;  // [M, units * 16]
  std::vector<float> lanes;    // [M, units * 16]
};

// 16 inputs as float32 (bfloat16 widened exactly).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) { return load_bf16(reinterpret_cast<const uint16_t*>(x), 0xFFFF); }

// Blocks of 32 to int8: scale max|x| / 127, round to nearest even (the default MXCSR mode,
// as torch.round does in the reference), as llama.cpp quantizes activations.
template <typename T>
Quantized quantize_rows(const T* x, int64_t m, int64_t k) {
  Quantized out;
  out.blocks = k / BLOCK;
  out.units = (out.blocks + 1) / 2;
  out.act = out.units * 64;
  out.q.assign(m * out.act, 0);
  out.start.assign(m * out.units * 16, 0);
  out.lanes.assign(m * out.units * 16, 0.f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < out.blocks; ++b) {
      const T* xb = x + i * k + b * BLOCK;
      const __m512 lo = load16(xb), hi = load16(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      int8_t* q = out.q.data() + i * out.act + b * BLOCK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
      // Lane sums: four consecutive elements each, eight lanes per block.
      alignas(64) int32_t s_lo[16], s_hi[16];
      _mm512_store_si512(s_lo, qlo);
      _mm512_store_si512(s_hi, qhi);
      const int64_t lane0 = i * out.units * 16 + b * 8;
      for (int t = 0; t < 8; ++t) {
        const int32_t* e = t < 4 ? s_lo + 4 * t : s_hi + 4 * (t - 4);
        out.start[lane0 + t] = -128 * (e[0] + e[1] + e[2] + e[3]);
        out.lanes[lane0 + t] = amax / 127.f;
      }
    }
  }
  return out;
}

// Unit u of one weight row (its 64 bytes at w; Full: both blocks there) against M quantized
// rows from ``first``; sw: each lane's weight scale.
template <int M, bool Full>
inline void unit_dots(const uint8_t* w, __mmask64 mask, __m512 sw, const Quantized& a, int64_t first, int64_t u,
                      __m512* acc) {
  if constexpr (Full) _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH_BYTES, _MM_HINT_NTA);
  const __m512i v = Full ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(mask, w);
  const __m512i wu = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));  // + 128: unsigned
  for (int m = 0; m < M; ++m) {
    const int64_t row = first + m, lane = (row * a.units + u) * 16;
    __m512i s = _mm512_loadu_si512(a.start.data() + lane);
    s = _mm512_dpbusd_epi32(s, wu, _mm512_loadu_si512(a.q.data() + row * a.act + u * 64));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sw, _mm512_loadu_ps(a.lanes.data() + lane)), acc[m]);
  }
}

// Each lane's block within a group of 16 blocks, for the group's unit u.
inline __m512i unit_lanes(int u) {
  alignas(64) int32_t index[16];
  for (int l = 0; l < 16; ++l) index[l] = u * 2 + l / 8;
  return _mm512_load_si512(index);
}

// One weight row against M quantized input rows (first: the first of them): M dot products.
// Blocks are walked 16 at a time (one load of their scales); one or two rows alternate two
// accumulators, so that a row's sums do not wait on each other.
template <int M>
void row_dots(const uint8_t* w, const at::Half* ws, const Quantized& a, int64_t first, float* dots) {
  constexpr int A = M <= 2 ? 2 : 1;
  const int64_t nb = a.blocks;
  __m512 acc[A][M];
  for (int j = 0; j < A; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  __m512i index[8];
  for (int u = 0; u < 8; ++u) index[u] = unit_lanes(u);
  int64_t g = 0;
  for (; g + 16 <= nb; g += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(ws + g) + PREFETCH_BYTES / 16, _MM_HINT_NTA);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + g)));
    const int64_t u0 = g / 2;
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u)
      unit_dots<M, true>(w + (u0 + u) * 64, ~0ULL, _mm512_permutexvar_ps(index[u], dw), a, first, u0 + u,
                         acc[u % A]);
  }
  if (g < nb) {  // the last, partial group: its blocks' bytes only
    const int64_t count = nb - g, u0 = g / 2;
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), ws + g));
    for (int u = 0; u * 2 < count; ++u) {
      const int64_t bytes = std::min<int64_t>(2, count - u * 2) * BLOCK;
      const __mmask64 mask = bytes == 64 ? ~0ULL : (1ULL << bytes) - 1;
      unit_dots<M, false>(w + (u0 + u) * 64, mask, _mm512_permutexvar_ps(index[u], dw), a, first, u0 + u,
                          acc[u % A]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = acc[0][m];
    for (int j = 1; j < A; ++j) sum = _mm512_add_ps(sum, acc[j][m]);
    dots[m] = _mm512_reduce_add_ps(sum);
  }
}

// dots [m, rows] for weight rows [begin, begin + rows) and input rows [first, first + m).
void rows_dots(const uint8_t* w, const at::Half* ws, int64_t begin, int64_t rows, const Quantized& a, int64_t first,
               int64_t m, float* dots) {
  const int64_t nb = a.blocks, row_bytes = nb * BLOCK;
  float row_out[GROUP];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + (begin + r) * row_bytes;
    const at::Half* scales = ws + (begin + r) * nb;
    switch (m) {
      case 1: row_dots<1>(row, scales, a, first, row_out); break;
      case 2: row_dots<2>(row, scales, a, first, row_out); break;
      case 3: row_dots<3>(row, scales, a, first, row_out); break;
      case 4: row_dots<4>(row, scales, a, first, row_out); break;
      case 5: row_dots<5>(row, scales, a, first, row_out); break;
      case 6: row_dots<6>(row, scales, a, first, row_out); break;
      case 7: row_dots<7>(row, scales, a, first, row_out); break;
      case 8: row_dots<8>(row, scales, a, first, row_out); break;
      default: TORCH_CHECK(false, "block_linear: a group of ", m, " rows");  // groups hold 1..GROUP
    }
    for (int64_t i = 0; i < m; ++i) dots[i * rows + r] = row_out[i];
  }
}

template <typename T>
void q8_0_linear_into(const Quantized& a, int64_t m, const at::Tensor& weight, const at::Tensor& scale,
                      const float* bias, bool silu_mul, T* out, int64_t width) {
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const at::Half* ws = scale.data_ptr<at::Half>();
  const Finish finish{nullptr, bias, width, silu_mul};
  const int64_t most = std::min(GROUP, m);  // input rows a group holds
  struct Sums {
    std::vector<float> gate, up;
  };
  const auto setup = [&] {
    return Sums{std::vector<float>(ROWS_PER_TASK * most), std::vector<float>(silu_mul ? ROWS_PER_TASK * most : 0)};
  };
  balanced_chunks(width, ROWS_PER_TASK, setup, [&](Sums& s, int64_t begin, int64_t end) {
    const int64_t rows = end - begin;
    for (int64_t first = 0; first < m; first += GROUP) {
      const int64_t group = std::min(GROUP, m - first);
      rows_dots(w, ws, begin, rows, a, first, group, s.gate.data());
      if (silu_mul) rows_dots(w, ws, width + begin, rows, a, first, group, s.up.data());
      finish.rows(s.gate.data(), s.up.data(), group, begin, rows, out + first * width);
    }
  });
}

#endif  // STEP14_BLOCK_DOT

// One weight row dequantized: value * scale in float32 (as the format's plain path computes it),
// then rounded once (to nearest even) where the output is bfloat16.
template <typename Out>
void dequantize_row(const uint8_t* row, const at::Half* ws, int64_t k, Kind kind, Out* out) {
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const float d = static_cast<float>(ws[b]);
    alignas(64) float o[BLOCK];
#ifdef STEP14_BLOCK_DOT
    __m512 lo, hi;
    if (kind == Kind::q4_0) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
      const __m512i eight = _mm512_set1_epi32(8);
      lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), eight));
      hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight));
    } else {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * BLOCK));
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    }
    lo = _mm512_mul_ps(lo, _mm512_set1_ps(d));
    hi = _mm512_mul_ps(hi, _mm512_set1_ps(d));
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_storeu_ps(out + b * BLOCK, lo);
      _mm512_storeu_ps(out + b * BLOCK + 16, hi);
      continue;
    }
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Out, at::BFloat16>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * BLOCK), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * BLOCK + 16), (__m256i)_mm512_cvtneps_pbh(hi));
      continue;
    }
#endif
    _mm512_store_ps(o, lo);
    _mm512_store_ps(o + 16, hi);
#else
    for (int j = 0; j < 32; ++j) {
      const int q = kind == Kind::q4_0 ? (j < 16 ? row[b * 16 + j] & 15 : row[b * 16 + j - 16] >> 4) - 8
                                       : static_cast<int>(reinterpret_cast<const int8_t*>(row)[b * BLOCK + j]);
      o[j] = static_cast<float>(q) * d;
    }
#endif
    for (int j = 0; j < 32; ++j) out[b * BLOCK + j] = static_cast<Out>(o[j]);
  }
}

// Rows interleaved by 16 (core/int4_format.py: Q4_0's bytes in words of 4, its scales alone):
// row r's words in order, from its group's block-major layout, into ``row`` / ``scales``.
void row_from_group(const uint8_t* w, const at::Half* ws, int64_t n, int64_t nb, int64_t r, uint8_t* row,
                    at::Half* scales) {
  const int64_t group = r / 16, rows = std::min<int64_t>(16, n - group * 16), i = r % 16;
  const uint8_t* gw = w + group * 16 * nb * 16;  // 16 bytes a block
  const at::Half* gs = ws + group * 16 * nb;
  for (int64_t word = 0; word < nb * 4; ++word) std::memcpy(row + word * 4, gw + (word * rows + i) * 4, 4);
  for (int64_t b = 0; b < nb; ++b) scales[b] = gs[b * rows + i];
}

// All weight rows dequantized into ``out`` ([N, K], float32 or bfloat16).
void dequantize_rows(const at::Tensor& weight, const at::Tensor& scale, Kind kind, at::Tensor& out) {
  const int64_t n = weight.size(0), nb = scale.size(1), k = nb * BLOCK, row_bytes = weight.size(1);
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const at::Half* ws = scale.data_ptr<at::Half>();
  const bool to_float = out.scalar_type() == at::kFloat;
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(kind == Kind::q4_0 ? row_bytes : 0);
    std::vector<at::Half> scales(kind == Kind::q4_0 ? nb : 0);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* src = w + r * row_bytes;
      const at::Half* s = ws + r * nb;
      if (kind == Kind::q4_0) {
        row_from_group(w, ws, n, nb, r, row.data(), scales.data());
        src = row.data(), s = scales.data();
      }
      if (to_float)
        dequantize_row(src, s, k, kind, out.data_ptr<float>() + r * k);
      else
        dequantize_row(src, s, k, kind, out.data_ptr<at::BFloat16>() + r * k);
    }
  });
}

}  // namespace

bool block_linear_available() {
#ifdef STEP14_BLOCK_DOT
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 or float32 (any M), weight in the block format ``bits`` names (4: Q4_0
// uint8 [N, K / 2], rows interleaved by 16 as core/int4_format.py stores them: lane_linear's;
// 8: Q8_0 int8 [N, K]), scale float16 [N, K / 32] (Q4_0's interleaved alike), bias [N] or
// undefined.
// silu_mul: the weight is a gate and an up projection stacked ([2I, ...]); returns
// silu(x gate^T) * (x up^T) [M, I], else x weight^T + bias [M, N], in x's dtype.
at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias, int64_t bits, bool silu_mul) {
  TORCH_CHECK(block_linear_available(), "block_linear: built without AVX-512 VNNI");
  const Kind kind = kind_of(bits, "block_linear");
  if (kind == Kind::q4_0) return lane_linear(x_in, weight, scale, bias, bits, silu_mul);
  check_block_input(x_in, "block_linear");
  check_weight(weight, scale, kind, x_in.size(1), "block_linear");
  check_bias(bias, weight.size(0), "block_linear");
  TORCH_CHECK(!silu_mul || weight.size(0) % 2 == 0, "block_linear: silu_mul needs gate and up rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), width = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, x.options());  // float32 sums, rounded once to x's dtype
  if (m == 0 || width == 0) return out;  // nothing to read
#ifdef STEP14_BLOCK_DOT
  const FloatBias bias_f(bias);
  const float* b = bias_f.data();
  auto run = [&](auto* xp, auto* op) { q8_0_linear_into(quantize_rows(xp, m, k), m, weight, scale, b, silu_mul, op, width); };
  if (x.scalar_type() == at::kBFloat16)
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else
    run(x.data_ptr<float>(), out.data_ptr<float>());
#endif
  return out;
}

// The block weight (as block_linear takes it) as a [N, K] tensor of ``dtype`` (bfloat16 or
// float32), rows in order, each value rounded once as the format's plain path rounds it: the
// reference for tests, not a compute path.
at::Tensor block_dequantize(const at::Tensor& weight, const at::Tensor& scale, int64_t bits, at::ScalarType dtype) {
  const Kind kind = kind_of(bits, "block_dequantize");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "block_dequantize: to bfloat16 or float32");
  TORCH_CHECK(scale.dim() == 2, "block_dequantize: float16 block scales [N, K / 32]");
  const int64_t k = scale.size(1) * BLOCK;
  check_weight(weight, scale, kind, k, "block_dequantize");
  at::Tensor out = at::empty({weight.size(0), k}, weight.options().dtype(dtype));
  dequantize_rows(weight, scale, kind, out);
  return out;
}
