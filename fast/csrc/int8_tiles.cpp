// Linears on 8-bit weights (int8, one float32 scale per output row) for many bfloat16 input rows
// (a decode step of several sequences, a short prompt chunk) on AMX's int8 tiles. The weight is
// streamed once as int8 whatever the number of rows, and never widened: each 16 weight rows are
// regrouped (a transpose of 4-byte groups) into tiles the core's cache holds, while the next 16
// rows are fetched. Tiles load at their best from contiguous, 64-byte-aligned 1 KB blocks: every
// operand is laid out so.
//
// The input rows are not quantized: each row is written exactly as a fixed-point integer on a
// grid of its own (2^t, t from its largest value), split into PLANES signed 7-bit digits; the
// tiles' int8 dot (tdpbssd, int32 sums: exact) runs once per digit plane and the planes' sums
// are recombined in float32. Every value within 2^20 of its row's largest is represented
// exactly (a bfloat16 has 8 significant bits); smaller ones to 2^-28 of the largest, finer than
// the float32 sums of a bfloat16 matmul round. Times the row's scale, rounded once to bfloat16,
// as int8_linear.cpp. Rows holding inf or NaN go to a float32 matmul.
// Built where the compiler targets AMX-INT8 and AVX-512 BF16; usable where Linux grants the
// tile registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "checks.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define STEP14_INT8_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd_math.h"
#endif

namespace {

constexpr int64_t TILE = 16;    // rows of a tile: 16 weight rows, or 16 input rows
constexpr int64_t CHUNK = 64;   // input features one tile spans (64 int8)
constexpr int PLANES = 4;       // 7-bit digits per input value (28 bits of fixed point)
constexpr int DIGIT_BITS = 7;

// Rows holding inf or NaN: the same product as a float32 matmul (inf and NaN as torch spreads them).
at::Tensor int8_tiles_fallback(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const at::Tensor& bias, bool silu_mul) {
  at::Tensor y = at::matmul(x.to(at::kFloat), weight.to(at::kFloat).t()) * scale;
  if (bias.defined()) y = y + bias;
  if (silu_mul) {
    const auto halves = y.chunk(2, 1);
    y = at::silu(halves[0]) * halves[1];
  }
  return y.to(x.scalar_type());
}

#ifdef STEP14_INT8_TILES
// The tile registers are off for a process until it asks Linux for them (once; oneDNN asks too).
bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: the planes' sums 0-3, input digits 4-5, weights 6.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = TILE;
  _tile_loadconfig(&config);
}

// One input row (row ``row`` of its block of 16) as digit planes, written into the block's
// tiles: tile (c, j) (1 KB, contiguous: the tiles load fastest so) holds plane j of features
// [64c, 64c + 64) of the block's 16 rows. Returns the row's grid t (value = integer * 2^t), or
// NaN where the row holds inf or NaN.
float encode_row(const uint16_t* x, int64_t k, int64_t chunks, int64_t row, int8_t* tiles) {
  __m512 peak = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    const __m512 v = _mm512_abs_ps(load_bf16(x + c, tail_mask(k - c)));
    if (_mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ)) return NAN;  // inf, or NaN (unordered)
    peak = _mm512_max_ps(peak, v);
  }
  const float top = _mm512_reduce_max_ps(peak);
  // top < 2^(ilogb(top) + 1) (exact, subnormals too): the integers stay below 2^(PLANES * DIGIT_BITS).
  const float t = top > 0 ? static_cast<float>(std::ilogb(top) + 1 - PLANES * DIGIT_BITS) : 0.f;
  const __m512 shift = _mm512_set1_ps(-t);
  for (int64_t c = 0; c < chunks * CHUNK; c += 16) {
    const __m512i whole = _mm512_cvtps_epi32(_mm512_scalef_ps(load_bf16(x + c, tail_mask(k - c)), shift));
    const __m512i size = _mm512_abs_epi32(whole);  // nearest: exact where the grid holds the value
    const __mmask16 negative = _mm512_movepi32_mask(whole);
    for (int j = 0; j < PLANES; ++j) {
      __m512i d = _mm512_and_si512(_mm512_srli_epi32(size, j * DIGIT_BITS), _mm512_set1_epi32(127));
      d = _mm512_mask_sub_epi32(d, negative, _mm512_setzero_si512(), d);
      int8_t* tile = tiles + ((c / CHUNK) * PLANES + j) * TILE * CHUNK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tile + row * CHUNK + c % CHUNK), _mm512_cvtepi32_epi8(d));
    }
  }
  return t;
}

// 16 x 16 32-bit elements transposed in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], lane L: rows 4i..4i+3 of column 4L + e
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Where a strip of 16 weight rows lies: rows [first, first + rows) of the [N, K] int8 weight.
struct StripSource {
  const int8_t* weight;
  int64_t k, first, rows;
};

// A strip in the tiles' right-operand layout, one 1 KB tile per chunk of 64 features: tile row
// q holds features 4q..4q+3 of each of the 16 weight rows (a 16 x 16 transpose of 4-byte
// groups). Rows past ``rows`` and features past k: zero.
void regroup_strip(const StripSource& src, int64_t chunks, int8_t* tiles) {
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t col = c * CHUNK, left = src.k - col;
    const __mmask64 m = left >= CHUNK ? ~0ull : (1ull << left) - 1;
    __m512i r[TILE];
    for (int64_t n = 0; n < TILE; ++n)
      r[n] = n < src.rows ? _mm512_maskz_loadu_epi8(m, src.weight + (src.first + n) * src.k + col) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t q = 0; q < TILE; ++q) _mm512_store_si512(tiles + c * TILE * CHUNK + q * CHUNK, r[q]);
  }
}

// Chunk c of a strip's rows fetched toward the core's second-level cache.
inline void fetch_chunk(const StripSource& src, int64_t c) {
  for (int64_t n = 0; n < src.rows; ++n)
    _mm_prefetch(reinterpret_cast<const char*>(src.weight + (src.first + n) * src.k + c * CHUNK), _MM_HINT_T1);
}

// Sums of one block of 16 encoded input rows (its tiles) against a regrouped strip of 16 weight
// rows, recombined: out[i][n] = sum_j plane_j[i][n] * 2^(grid[i] + 7j), float32. ``next``: the
// strip regrouped after this one, fetched meanwhile (its bytes arrive while the tiles work).
void block_by_strip(const int8_t* block, const int8_t* strip, int64_t chunks, const float* grid,
                    const StripSource* next, float* out) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    if (next) fetch_chunk(*next, c);
    const int8_t* a = block + c * PLANES * TILE * CHUNK;
    _tile_loadd(6, strip + c * TILE * CHUNK, 64);
    _tile_loadd(4, a, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(5, a + TILE * CHUNK, 64);
    _tile_dpbssd(1, 5, 6);
    _tile_loadd(4, a + 2 * TILE * CHUNK, 64);
    _tile_dpbssd(2, 4, 6);
    _tile_loadd(5, a + 3 * TILE * CHUNK, 64);
    _tile_dpbssd(3, 5, 6);
  }
  alignas(64) int32_t sums[PLANES][TILE * TILE];
  _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);
  for (int64_t i = 0; i < TILE; ++i) {
    __m512 v = _mm512_setzero_ps();
    for (int j = PLANES - 1; j >= 0; --j)
      v = _mm512_add_ps(v, _mm512_scalef_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[j] + i * TILE)),
                                            _mm512_set1_ps(grid[i] + j * DIGIT_BITS)));
    _mm512_storeu_ps(out + i * TILE, v);
  }
}

// silu(g) = g / (1 + exp(-g)), with exp of -|g| only (no overflow; past |g| = 87 it is 0 in float32).
inline __m512 silu16(__m512 g) {
  const __m512 size = _mm512_abs_ps(g);
  const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(size, _mm512_set1_ps(87.f), _CMP_LE_OQ),
                                       exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), size)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 top = _mm512_mask_mul_ps(g, negative, g, e);  // g < 0: g e^g / (1 + e^g)
  return _mm512_div_ps(top, _mm512_add_ps(one, e));
}

// Rows [0, m) of 16 output columns from the recombined sums (float32, [blocks * 16][16] per strip;
// silu_mul: the up rows' sums ``up_at`` further): times the rows' scales, plus bias, (silu(gate)
// * up), rounded once to bfloat16.
void write_rows(const float* sums, int64_t up_at, int64_t m, const float* scale, const float* bias, int64_t col,
                int64_t cols, int64_t width, bool silu_mul, at::BFloat16* out) {
  const __mmask16 mask = tail_mask(cols);
  const auto affine = [&](const float* at, int64_t first) {
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, at), _mm512_maskz_loadu_ps(mask, scale + first));
    return bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + first)) : v;
  };
  for (int64_t i = 0; i < m; ++i) {
    __m512 g = affine(sums + i * TILE, col);
    if (silu_mul) g = _mm512_mul_ps(silu16(g), affine(sums + up_at + i * TILE, width + col));
    _mm256_mask_storeu_epi16(out + i * width + col, mask, (__m256i)_mm512_cvtneps_pbh(g));
  }
}
#endif

}  // namespace

bool int8_tiles_available() {
#ifdef STEP14_INT8_TILES
  return tiles_permitted();
#else
  return false;
#endif
}

// x [M, K] bfloat16, weight [N, K] int8 contiguous, scale [N], bias [N] or undefined; as
// int8_linear (silu_mul: gate and up stacked, returns silu(x gate^T) * (x up^T)) for any M.
at::Tensor int8_tiles(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale_in,
                      const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(int8_tiles_available(), "int8_tiles: built without AMX-INT8, or the tile registers are refused");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
              "int8_tiles: x [M, K] and weight [N, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  x_in.device().is_cpu() && weight.device().is_cpu(),
              "int8_tiles: bfloat16 input, contiguous int8 weight, CPU tensors");
  check_row_scales(scale_in, weight.size(0), "int8_tiles");
  check_bias(bias, weight.size(0), "int8_tiles");
  TORCH_CHECK(!silu_mul || weight.size(0) % 2 == 0, "int8_tiles: silu_mul needs gate and up rows");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), width = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, width}, x.options());
  const FloatBias bias_f(bias);
  const float* b = bias_f.data();
  if (m == 0 || width == 0) return out;
#ifdef STEP14_INT8_TILES
  const int64_t chunks = (k + CHUNK - 1) / CHUNK, blocks = (m + TILE - 1) / TILE;
  const int64_t block_bytes = chunks * PLANES * TILE * CHUNK;
  // Tiles load at their best from 64-byte-aligned rows (torch's CPU allocator aligns to 64).
  const at::Tensor digit_tiles = at::zeros({blocks * block_bytes}, weight.options());  // zero: the padding
  int8_t* digits = digit_tiles.data_ptr<int8_t>();
  std::vector<float> grid(blocks * TILE, 0.f);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, m, TILE, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      grid[i] = encode_row(xp + i * k, k, chunks, i % TILE, digits + (i / TILE) * block_bytes);
  });
  if (std::any_of(grid.begin(), grid.end(), [](float t) { return std::isnan(t); }))
    return int8_tiles_fallback(x, weight, scale, bias_f.tensor, silu_mul);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t tasks = (width + TILE - 1) / TILE;  // 16 output columns (and their up rows) each
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    const at::Tensor strip_tiles = at::empty({chunks * TILE * CHUNK}, weight.options());
    int8_t* strip = strip_tiles.data_ptr<int8_t>();
    std::vector<float> sums((silu_mul ? 2 : 1) * blocks * TILE * TILE);
    const int64_t parts = silu_mul ? 2 : 1;
    const auto source = [&](int64_t t, int64_t j) {  // strip j (gate, up) of task t
      const int64_t col = t * TILE;
      return StripSource{wp, k, col + j * width, std::min(TILE, width - col)};
    };
    for (int64_t t = begin; t < end; ++t) {
      const int64_t col = t * TILE, cols = std::min(TILE, width - col);
      for (int64_t j = 0; j < parts; ++j) {
        regroup_strip(source(t, j), chunks, strip);
        const bool more = j + 1 < parts || t + 1 < end;
        const StripSource next = j + 1 < parts ? source(t, j + 1) : source(std::min(t + 1, end - 1), 0);
        for (int64_t blk = 0; blk < blocks; ++blk)
          block_by_strip(digits + blk * block_bytes, strip, chunks, &grid[blk * TILE], more && blk == 0 ? &next : nullptr,
                         sums.data() + (j * blocks + blk) * TILE * TILE);
      }
      write_rows(sums.data(), blocks * TILE * TILE, m, s, b, col, cols, width, silu_mul, op);
    }
    _tile_release();
  });
#endif
  return out;
}
