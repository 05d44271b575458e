// Attention over the paged KV pool, straight from the blocks (no gather, no padding), softmax
// in float32: decode rows (one query token each, every query head of a KV head group at once),
// prompt chunks (tiles of query rows), and decode rows that share leading blocks. The same
// result as model.py's paged_attention for these rows.
//
// On a CPU with AVX-512 every kernel computes each query row by one recipe (below), so a row's
// bits do not depend on which kernel ran it or on what else was in the call; the next blocks are
// prefetched (blocks sit anywhere in the pool, where the hardware prefetcher does not follow).
// Elsewhere the decode kernel runs the same loops in plain C++ (two passes: scores, then the
// softmax-weighted values), and prompt chunks are left to PyTorch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "balance.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STEP14_AVX512 1
#include <immintrin.h>

#include "simd_math.h"
#endif

namespace {

// Where one (row, KV head) reads and writes.
template <typename T>
struct Task {
  const T* q;            // [group, dim] rows spaced q_stride apart
  int64_t q_stride;
  const T* k;            // this KV head's pool, [slots, dim]
  const T* v;
  const int64_t* table;  // the row's block table
  int64_t lo, hi;        // visible key positions [lo, hi)
  T* out;                // [group, dim] rows spaced out_stride apart
  int64_t out_stride;
};

struct Shape {
  int64_t block_size, group, dim;
  float scale;
};

// ----------------------------------------------------------------------------- plain C++

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
void attend_plain(const Task<T>& t, const Shape& s, float* scores, float* query, float* acc) {
  const int64_t count = t.hi - t.lo, dim = s.dim, group = s.group;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = to_float(t.q[g * t.q_stride + d]) * s.scale;
  for (int64_t p = t.lo; p < t.hi; ++p) {
    const T* row = t.k + (t.table[p / s.block_size] * s.block_size + p % s.block_size) * dim;
    for (int64_t g = 0; g < group; ++g) {
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) sum += query[g * dim + d] * to_float(row[d]);
      scores[g * count + (p - t.lo)] = sum;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * count;
    const float peak = *std::max_element(sg, sg + count);
    float total = 0.f;
    for (int64_t j = 0; j < count; ++j) total += (sg[j] = std::exp(sg[j] - peak));
    for (int64_t j = 0; j < count; ++j) sg[j] /= total;
  }
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t p = t.lo; p < t.hi; ++p) {
    const T* row = t.v + (t.table[p / s.block_size] * s.block_size + p % s.block_size) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * count + (p - t.lo)];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += w * to_float(row[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) t.out[g * t.out_stride + d] = static_cast<T>(acc[g * dim + d]);
}

// ----------------------------------------------------------------------------- AVX-512

#ifdef STEP14_AVX512
constexpr int64_t LANES = 16;

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 m) { return load_bf16(reinterpret_cast<const uint16_t*>(p), m); }
inline __m512 load(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// ----------------------------------------------------------------------------- the row recipe
//
// Every AVX-512 kernel below computes a query row (one query head at one position) by this one
// recipe, so a row's output depends only on its query and the keys and values it sees -- never on
// the kernel (decode, prompt chunk, shared prefix) or on which rows share its call. That is what
// lets the prefix cache, chunked prefill and batching leave every token as it was:
//
//   * the keys come in groups: each block's keys 16 at a time from the block's first slot; a row
//     skips a group without a key it sees, and gives probability 0 to the keys it does not see;
//   * score = (q * scale) . k: per lane the products of one dim lane chained by fma over the
//     head's 16-wide chunks (zeros past dim), the 16 lanes summed by one fixed tree (sum4's);
//     bfloat16 with AVX-512 BF16: (q . k) * scale, per lane a chain of pair dots over 32-wide
//     chunks of q's own bits, the same tree, then the scale (PAIR_DOTS);
//   * an online softmax, group by group: top = max(run max, scores), alpha = exp(run max - top),
//     p = exp(score - top), run sum = run sum * alpha + tree(p) (one fma), values = values * alpha
//     then + p_k * v_k key by key, in position order;
//   * out = values * (1 / run sum).
constexpr int KEYS = 16;  // keys per group; also rows per tile

// Sums of four vectors' lanes: {sum a0, sum a1, sum a2, sum a3} by one tree: within each 128-bit
// quarter (x0 + x2) + (x1 + x3), then quarters (Q0 + Q2) + (Q1 + Q3).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

inline float tree_sum(__m512 a) {
  const __m512 zero = _mm512_setzero_ps();
  return _mm_cvtss_f32(sum4(a, zero, zero, zero));
}

inline float exp_of(float x) { return _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(x))); }

// Rows attending one sequence's keys together (at most KEYS): scaled queries and weighted values
// [n][width] (zeros past dim), and per row its visible keys [lo, hi) and running max and sum.
// A view of some rows is the same pointers moved on.
struct RowSet {
  int n;
  int64_t width;
  float *qs, *acc, *run_max, *run_sum;
  const int64_t *lo, *hi;
  float scale;  // the scores' factor where the queries are kept unscaled (bfloat16 pairs, below)

  RowSet rows(int first, int count) const {
    return RowSet{count, width, qs + first * width, acc + first * width, run_max + first, run_sum + first,
                  lo + first, hi + first, scale};
  }
};

// Scratch of one thread: a RowSet's arrays and a group's scores and probabilities.
struct RowScratch {
  int64_t width;
  std::vector<float> qs, acc, run_max, run_sum, scores, probs, alpha, all_scores, ot, vf;
  std::vector<int64_t> lo, hi;
  explicit RowScratch(int64_t dim)
      : width((dim + LANES - 1) / LANES * LANES), qs(KEYS * width), acc(KEYS * width), run_max(KEYS),
        run_sum(KEYS), scores(KEYS * KEYS), probs(KEYS * KEYS), alpha(KEYS), vf(KEYS * width), lo(KEYS), hi(KEYS) {}

  RowSet start(int n, float scale) {
    std::fill(acc.begin(), acc.begin() + n * width, 0.f);
    std::fill(run_max.begin(), run_max.begin() + n, -INFINITY);
    std::fill(run_sum.begin(), run_sum.begin() + n, 0.f);
    return RowSet{n, width, qs.data(), acc.data(), run_max.data(), run_sum.data(), lo.data(), hi.data(), scale};
  }
};

// Bfloat16 scores by AVX-512 BF16's pair dot product (vdpbf16ps: 32 products an instruction, where
// an fma takes 16): the query stays bfloat16 and the sum is scaled after the tree. Every kernel
// takes the same path, so a row's bits stay one recipe's on this CPU.
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool PAIR_DOTS = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool PAIR_DOTS = false;
#endif

// Row r's query as score_rows reads it: q * scale in float32 (zeros past dim), or for pair dots
// q's own bfloat16 bits, zeros past dim to the next 32.
template <typename T>
inline void scale_query(const T* q, int64_t dim, float scale, float* dst) {
  if constexpr (PAIR_DOTS<T>) {
    auto* bits = reinterpret_cast<uint16_t*>(dst);
    for (int64_t c = 0; c * 32 < dim; ++c) {
      const __mmask32 m = dim - c * 32 >= 32 ? ~0u : (1u << (dim - c * 32)) - 1;
      _mm512_storeu_si512(bits + c * 32, _mm512_maskz_loadu_epi16(m, q + c * 32));
    }
    return;
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t c = 0; c * LANES < dim; ++c)
    _mm512_storeu_ps(dst + c * LANES, _mm512_mul_ps(load(q + c * LANES, tail_mask(dim - c * LANES)), s));
}

// A finished row: values * (1 / run sum) into out.
template <typename T>
inline void write_row(const float* acc, float run_sum, int64_t dim, T* out) {
  const float inv = 1.0f / run_sum;
  alignas(64) float lanes[LANES];
  for (int64_t c = 0; c * LANES < dim; ++c) {
    _mm512_store_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(acc + c * LANES), _mm512_set1_ps(inv)));
    for (int64_t d = 0; d < std::min<int64_t>(LANES, dim - c * LANES); ++d) out[c * LANES + d] = static_cast<T>(lanes[d]);
  }
}

// Four keys at a time of k0[0 .. n) (rows dim apart): for each of RB rows, per lane a chain of
// ``add(c, keys, sums)`` over the head's steps c, then sum4's tree (times *scale, if given).
template <int RB, typename T, typename Add>
inline void score_fours(const T* k0, int n, int64_t dim, int64_t steps, const __m128* scale, float* scores,
                        int64_t stride, const Add& add) {
  for (int kq = 0; kq < n; kq += 4) {
    const T* keys[4];
    for (int j = 0; j < 4; ++j) keys[j] = k0 + std::min(kq + j, n - 1) * dim;  // past n: scored, unused
    __m512 a[RB][4];
    STEP14_UNROLL for (int r = 0; r < RB; ++r)
      STEP14_UNROLL for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < steps; ++c) add(c, keys, a);
    STEP14_UNROLL for (int r = 0; r < RB; ++r) {
      const __m128 sum = sum4(a[r][0], a[r][1], a[r][2], a[r][3]);
      _mm_storeu_ps(scores + r * stride + kq, scale ? _mm_mul_ps(sum, *scale) : sum);
    }
  }
}

// Scores of RB rows against the group's keys k0[0 .. n) (rows dim apart): scores [RB][KEYS].
// CH: the head's chunks of 16 where the compiler knows them (full loads, unrolled), 0 for any.
template <typename T, int CH, int RB>
void score_rows(const RowSet& rs, int r0, const T* k0, int n, int64_t dim, float* scores, int64_t stride) {
#if defined(__AVX512BF16__)
  if constexpr (PAIR_DOTS<T>) {  // 32 dims a step: per lane a chain of pair dots, then the scale
    const int64_t pairs = CH ? (CH + 1) / 2 : (dim + 31) / 32, rest = dim - (pairs - 1) * 32;
    const __mmask32 last = rest >= 32 ? ~0u : (1u << rest) - 1;
    const auto* qbits = reinterpret_cast<const uint16_t*>(rs.qs);
    const __m128 scale = _mm_set1_ps(rs.scale);
    score_fours<RB>(k0, n, dim, pairs, &scale, scores, stride, [&](int64_t c, const T* const* keys, __m512 (&a)[RB][4]) {
      const __mmask32 m = c + 1 == pairs ? last : ~0u;
      __m512bh k[4];
      STEP14_UNROLL for (int j = 0; j < 4; ++j) k[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, keys[j] + c * 32);
      STEP14_UNROLL for (int r = 0; r < RB; ++r) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qbits + (r0 + r) * 2 * rs.width + c * 32);
        STEP14_UNROLL for (int j = 0; j < 4; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], q, k[j]);
      }
    });
    return;
  }
#endif
  const int64_t chunks = CH ? CH : (dim + LANES - 1) / LANES;
  const __mmask16 last = CH ? static_cast<__mmask16>(0xFFFF) : tail_mask(dim - (chunks - 1) * LANES);
  score_fours<RB>(k0, n, dim, chunks, nullptr, scores, stride, [&](int64_t c, const T* const* keys, __m512 (&a)[RB][4]) {
    const __mmask16 m = c + 1 == chunks ? last : static_cast<__mmask16>(0xFFFF);
    __m512 k[4];
    STEP14_UNROLL for (int j = 0; j < 4; ++j) k[j] = load(keys[j] + c * LANES, m);
    STEP14_UNROLL for (int r = 0; r < RB; ++r) {
      const __m512 q = _mm512_loadu_ps(rs.qs + (r0 + r) * rs.width + c * LANES);
      STEP14_UNROLL for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(q, k[j], a[r][j]);
    }
  });
}

// values = values * alpha + sum_k p_k v_k for RB rows, CH chunks of the head held in registers.
template <typename T, int CH, int RB>
void weigh_values_fixed(const RowSet& rs, int r0, const float* probs, const float* alpha, const T* v0, int n) {
  __m512 a[RB][CH];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CH; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(rs.acc + (r0 + r) * rs.width + c * LANES), _mm512_set1_ps(alpha[r0 + r]));
  for (int k = 0; k < n; ++k)
    for (int c = 0; c < CH; ++c) {
      const __m512 v = load(v0 + k * CH * LANES + c * LANES, 0xFFFF);
      for (int r = 0; r < RB; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[(r0 + r) * KEYS + k]), v, a[r][c]);
    }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(rs.acc + (r0 + r) * rs.width + c * LANES, a[r][c]);
}

// The same arithmetic for any head size: a chunk at a time, four rows at a time.
template <typename T>
void weigh_values_any(const RowSet& rs, const float* probs, const float* alpha, const T* v0, int n, int64_t dim) {
  for (int64_t c = 0; c * LANES < dim; ++c) {
    const __mmask16 m = tail_mask(dim - c * LANES);
    for (int r0 = 0; r0 < rs.n; r0 += 4) {
      const int rb = std::min(4, rs.n - r0);
      __m512 a[4];
      for (int r = 0; r < rb; ++r)
        a[r] = _mm512_mul_ps(_mm512_loadu_ps(rs.acc + (r0 + r) * rs.width + c * LANES), _mm512_set1_ps(alpha[r0 + r]));
      for (int k = 0; k < n; ++k) {
        const __m512 v = load(v0 + k * dim + c * LANES, m);
        for (int r = 0; r < rb; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(probs[(r0 + r) * KEYS + k]), v, a[r]);
      }
      for (int r = 0; r < rb; ++r) _mm512_storeu_ps(rs.acc + (r0 + r) * rs.width + c * LANES, a[r]);
    }
  }
}

template <typename T, int CH>
void weigh_values(const RowSet& rs, const float* probs, const float* alpha, const T* v0, int n) {
  constexpr int RB = CH <= 4 ? 4 : CH <= 8 ? 2 : 1;  // at most 16 registers of sums
  int r0 = 0;
  for (; r0 + RB <= rs.n; r0 += RB) weigh_values_fixed<T, CH, RB>(rs, r0, probs, alpha, v0, n);
  for (; r0 < rs.n; ++r0) weigh_values_fixed<T, CH, 1>(rs, r0, probs, alpha, v0, n);
}

// The scores of one group of keys, positions [kp, kp + n) at k0 (rows dim apart): row r's
// at scores + r * stride.
template <typename T, int CH>
void score_group(const RowSet& rs, const T* k0, int n, int64_t dim, float* scores, int64_t stride) {
  int r0 = 0;
  for (; r0 + 4 <= rs.n; r0 += 4) score_rows<T, CH, 4>(rs, r0, k0, n, dim, scores + r0 * stride, stride);
  switch (rs.n - r0) {
    case 3: score_rows<T, CH, 3>(rs, r0, k0, n, dim, scores + r0 * stride, stride); break;
    case 2: score_rows<T, CH, 2>(rs, r0, k0, n, dim, scores + r0 * stride, stride); break;
    case 1: score_rows<T, CH, 1>(rs, r0, k0, n, dim, scores + r0 * stride, stride); break;
    default: break;
  }
}

// That group's scores into the rows' softmax, and its values (v0) into their weighted sums.
template <typename T, int CH>
void weigh_group(RowSet& rs, const float* scores, int64_t stride, const T* v0, int64_t kp, int n, int64_t dim,
                 RowScratch& scratch) {
  float *probs = scratch.probs.data(), *alpha = scratch.alpha.data();
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int r = 0; r < rs.n; ++r) {
    // Keys kp + k this row sees: lo <= kp + k < hi, k < n.
    const int64_t from = std::max<int64_t>(rs.lo[r] - kp, 0), to = std::min<int64_t>(rs.hi[r] - kp, n);
    const __mmask16 seen = from < to ? static_cast<__mmask16>(tail_mask(to) & ~tail_mask(from)) : 0;
    if (!seen) {  // nothing here for this row: its state stays exactly as it is
      alpha[r] = 1.0f;
      _mm512_storeu_ps(probs + r * KEYS, _mm512_setzero_ps());
      continue;
    }
    const __m512 sc = _mm512_mask_mov_ps(neg_inf, seen, _mm512_maskz_loadu_ps(seen, scores + r * stride));
    const float top = std::max(rs.run_max[r], _mm512_reduce_max_ps(sc));
    const float a = rs.run_max[r] == -INFINITY ? 0.f : exp_of(rs.run_max[r] - top);
    const __m512 p = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(top))));
    rs.run_sum[r] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(rs.run_sum[r]), _mm_set_ss(a), _mm_set_ss(tree_sum(p))));
    rs.run_max[r] = top;
    alpha[r] = a;
    _mm512_storeu_ps(probs + r * KEYS, p);
  }
  if constexpr (CH > 0) weigh_values<T, CH>(rs, probs, alpha, v0, n);
  else weigh_values_any(rs, probs, alpha, v0, n, dim);
}

// weigh_group for a tile's rows, a lane per row: the same arithmetic per element (the softmax
// by lanes instead of one row at a time; each value times a probability and added, key by key),
// so every row's bits are the row-by-row recipe's. The running sums are kept [dim][16].
struct TileState {
  __m512 run_max, run_sum;
  float* ot;  // [dim][KEYS]

  static TileState of(const RowSet& rs, RowScratch& scratch) {  // the rows' state, a lane each
    scratch.ot.assign(rs.width * KEYS, 0.f);
    alignas(64) float m[KEYS], l[KEYS];
    for (int r = 0; r < KEYS; ++r) {
      m[r] = r < rs.n ? rs.run_max[r] : -INFINITY;
      l[r] = r < rs.n ? rs.run_sum[r] : 0.f;
    }
    for (int r = 0; r < rs.n; ++r)
      for (int64_t d = 0; d < rs.width; ++d) scratch.ot[d * KEYS + r] = rs.acc[r * rs.width + d];
    return TileState{_mm512_load_ps(m), _mm512_load_ps(l), scratch.ot.data()};
  }

  void put(RowSet& rs) const {  // back into the rows' own layout
    alignas(64) float m[KEYS], l[KEYS];
    _mm512_store_ps(m, run_max);
    _mm512_store_ps(l, run_sum);
    for (int r = 0; r < rs.n; ++r) {
      rs.run_max[r] = m[r];
      rs.run_sum[r] = l[r];
      for (int64_t d = 0; d < rs.width; ++d) rs.acc[r * rs.width + d] = ot[d * KEYS + r];
    }
  }
};

// The recipe's sum of 16 probabilities, lane by lane over keys: sum4's tree.
inline __m512 tree_over_keys(const __m512* p) {
  __m512 q[4];
  for (int j = 0; j < 4; ++j)
    q[j] = _mm512_add_ps(_mm512_add_ps(p[4 * j], p[4 * j + 2]), _mm512_add_ps(p[4 * j + 1], p[4 * j + 3]));
  return _mm512_add_ps(_mm512_add_ps(q[0], q[2]), _mm512_add_ps(q[1], q[3]));
}

template <typename T>
void tile_weigh_group(TileState& st, const RowSet& rs, const float* scores, const T* v0, int64_t kp, int n,
                      int64_t dim, RowScratch& scratch) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  alignas(64) int32_t lo[KEYS], hi[KEYS];
  for (int r = 0; r < KEYS; ++r) {
    lo[r] = r < rs.n ? static_cast<int32_t>(std::max<int64_t>(rs.lo[r] - kp, 0)) : 0;
    hi[r] = r < rs.n ? static_cast<int32_t>(std::min<int64_t>(rs.hi[r] - kp, n)) : 0;
  }
  const __m512i lo_v = _mm512_load_si512(lo), hi_v = _mm512_load_si512(hi);
  alignas(64) float col[KEYS * KEYS];  // scores [key][row]
  for (int r = 0; r < rs.n; ++r)
    for (int k = 0; k < KEYS; ++k) col[k * KEYS + r] = scores[r * KEYS + k];
  __m512 sc[KEYS];
  __mmask16 seen[KEYS], any = 0;
  __m512 top = st.run_max;
  for (int k = 0; k < KEYS; ++k) {
    const __m512i key = _mm512_set1_epi32(k);
    seen[k] = k < n ? _mm512_cmp_epi32_mask(lo_v, key, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(key, hi_v, _MM_CMPINT_LT)
                    : static_cast<__mmask16>(0);
    any |= seen[k];
    sc[k] = _mm512_mask_loadu_ps(neg_inf, seen[k], col + k * KEYS);
    top = _mm512_max_ps(top, sc[k]);
  }
  // Lanes with no key here keep their state exactly: alpha 1, probabilities 0.
  const __mmask16 had = _mm512_cmp_ps_mask(st.run_max, neg_inf, _CMP_NEQ_OQ);
  const __m512 alpha = _mm512_mask_blend_ps(any, _mm512_set1_ps(1.0f),
                                            _mm512_maskz_mov_ps(had, exp_nonpositive(_mm512_sub_ps(st.run_max, top))));
  __m512 p[KEYS];
  float* probs = scratch.probs.data();
  for (int k = 0; k < KEYS; ++k) {
    p[k] = _mm512_maskz_mov_ps(seen[k], exp_nonpositive(_mm512_sub_ps(sc[k], top)));
    _mm512_storeu_ps(probs + k * KEYS, p[k]);
  }
  st.run_sum = _mm512_mask_fmadd_ps(st.run_sum, any, alpha, tree_over_keys(p));
  st.run_max = _mm512_mask_mov_ps(st.run_max, any, top);
  float* vf = scratch.vf.data();
  for (int k = 0; k < n; ++k)
    for (int64_t c = 0; c * LANES < dim; ++c)
      _mm512_storeu_ps(vf + k * rs.width + c * LANES, load(v0 + k * dim + c * LANES, tail_mask(dim - c * LANES)));
  float* ot = st.ot;
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + j) * KEYS), alpha);
    for (int k = 0; k < n; ++k) {
      const __m512 pk = _mm512_loadu_ps(probs + k * KEYS);
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(vf[k * rs.width + d + j]), pk, acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm512_storeu_ps(ot + (d + j) * KEYS, acc[j]);
  }
  for (; d < dim; ++d) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(ot + d * KEYS), alpha);
    for (int k = 0; k < n; ++k)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(vf[k * rs.width + d]), _mm512_loadu_ps(probs + k * KEYS), acc);
    _mm512_storeu_ps(ot + d * KEYS, acc);
  }
}

// Keys [from, to) of one sequence (``table``) into the rows' state, group by group. Few rows
// (decode) take two passes, as the keys' scores then the values (two streams read one after
// the other, which memory serves faster); more rows (a tile) score and weigh each group in
// turn, while it is in cache. Both are the recipe, to the bit. The next keys and values are
// fetched meanwhile: blocks sit anywhere in the pool, where the hardware prefetcher does not follow.
constexpr int64_t PREFETCH_KEYS = 32;
constexpr int TWO_PASS_ROWS = 4;

template <typename T>
inline void prefetch_keys(const T* pool, const int64_t* table, int64_t from, int64_t to, int64_t bs, int64_t dim) {
  for (int64_t p = from; p < to;) {
    const int64_t end = std::min(to, (p / bs + 1) * bs), row0 = (table[p / bs] * bs + p % bs) * dim;
    prefetch_lines<_MM_HINT_NTA>(pool + row0, (end - p) * dim * static_cast<int64_t>(sizeof(T)));
    p = end;
  }
}

// Calls each(group index, first position, count, offset of the first key's row) group by group
// over [from, to), the next rows of ``pool`` (and of ``also``, if given) fetched ahead.
template <typename T, typename Each>
inline void for_each_group(const T* pool, const T* also, const int64_t* table, int64_t from, int64_t to,
                           int64_t bs, int64_t dim, Each each) {
  const auto fetch = [&](int64_t a, int64_t b) {
    prefetch_keys(pool, table, a, b, bs, dim);
    if (also) prefetch_keys(also, table, a, b, bs, dim);
  };
  int64_t kp = from / bs * bs + from % bs / KEYS * KEYS;  // the group holding ``from``
  fetch(kp, std::min(to, kp + PREFETCH_KEYS));
  for (int64_t gi = 0; kp < to; ++gi) {
    const int64_t blk = kp / bs;
    const int n = static_cast<int>(std::min({static_cast<int64_t>(KEYS), (blk + 1) * bs - kp, to - kp}));
    fetch(std::min(to, kp + PREFETCH_KEYS), std::min(to, kp + n + PREFETCH_KEYS));
    each(gi, kp, n, (table[blk] * bs + kp % bs) * dim);
    kp += n;
  }
}

template <typename T, int CH>
void rows_over_keys_by(RowSet& rs, const T* pool_k, const T* pool_v, const int64_t* table, int64_t from, int64_t to,
                       int64_t block_size, int64_t dim, RowScratch& scratch) {
  const int64_t bs = block_size;
  if (rs.n > TWO_PASS_ROWS) {
    TileState st = TileState::of(rs, scratch);
    float* scores = scratch.scores.data();
    for_each_group(pool_k, pool_v, table, from, to, bs, dim, [&](int64_t, int64_t kp, int n, int64_t row0) {
      score_group<T, CH>(rs, pool_k + row0, n, dim, scores, KEYS);
      tile_weigh_group(st, rs, scores, pool_v + row0, kp, n, dim, scratch);
    });
    st.put(rs);
    return;
  }
  const int64_t first = from / bs * bs + from % bs / KEYS * KEYS, groups = (to - first + KEYS - 1) / KEYS + (to - first) / bs + 1;
  const int64_t stride = groups * KEYS;  // an upper bound on the groups (a block's last may be short)
  if (static_cast<int64_t>(scratch.all_scores.size()) < rs.n * stride) scratch.all_scores.resize(rs.n * stride);
  float* scores = scratch.all_scores.data();
  for_each_group(pool_k, static_cast<const T*>(nullptr), table, from, to, bs, dim,
                 [&](int64_t gi, int64_t, int n, int64_t row0) {
    score_group<T, CH>(rs, pool_k + row0, n, dim, scores + gi * KEYS, stride);
  });
  for_each_group(pool_v, static_cast<const T*>(nullptr), table, from, to, bs, dim,
                 [&](int64_t gi, int64_t kp, int n, int64_t row0) {
    weigh_group<T, CH>(rs, scores + gi * KEYS, stride, pool_v + row0, kp, n, dim, scratch);
  });
}

// The same for any head size: compiled for 64 and 128, where most models are.
template <typename T>
void rows_over_keys(RowSet& rs, const T* pool_k, const T* pool_v, const int64_t* table, int64_t from, int64_t to,
                    int64_t block_size, int64_t dim, RowScratch& scratch) {
  switch (dim) {
    case 4 * LANES: return rows_over_keys_by<T, 4>(rs, pool_k, pool_v, table, from, to, block_size, dim, scratch);
    case 8 * LANES: return rows_over_keys_by<T, 8>(rs, pool_k, pool_v, table, from, to, block_size, dim, scratch);
    default: return rows_over_keys_by<T, 0>(rs, pool_k, pool_v, table, from, to, block_size, dim, scratch);
  }
}

// A decode task: one row's query heads of one KV head, keys [lo, hi); at most KEYS heads at a
// time (each head is a row of its own: how they are grouped changes no bit).
template <typename T>
void attend_recipe(const Task<T>& t, const Shape& s, RowScratch& scratch) {
  for (int64_t h0 = 0; h0 < s.group; h0 += KEYS) {
    RowSet rs = scratch.start(static_cast<int>(std::min<int64_t>(KEYS, s.group - h0)), s.scale);
    for (int r = 0; r < rs.n; ++r) {
      scale_query(t.q + (h0 + r) * t.q_stride, s.dim, s.scale, rs.qs + r * rs.width);
      scratch.lo[r] = t.lo;
      scratch.hi[r] = t.hi;
    }
    rows_over_keys(rs, t.k, t.v, t.table, t.lo, t.hi, s.block_size, s.dim, scratch);
    for (int r = 0; r < rs.n; ++r)
      write_row(rs.acc + r * rs.width, rs.run_sum[r], s.dim, t.out + (h0 + r) * t.out_stride);
  }
}
#endif

// The decode rows of one call: their query tokens, block tables and visible positions.
struct Rows {
  const int64_t *row, *table;
  int64_t width;
  const int64_t *lo, *hi;
  int64_t count, longest;
};

// Every (row, KV head) pair, spread over torch's threads: the row recipe where AVX-512 is there
// (unless ``vector`` is false), else the plain loops.
template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v,
                 at::Tensor& out, const Rows& rows, const Shape& s, bool vector) {
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1), dim = s.dim, group = s.group;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  balanced_for(rows.count * kv_heads, [&](Claims& claims) {
#ifdef STEP14_AVX512
    std::unique_ptr<RowScratch> scratch = vector ? std::make_unique<RowScratch>(dim) : nullptr;
#endif
    std::vector<float> scores, query, acc;
    if (!vector) scores.resize(group * rows.longest), query.resize(group * dim), acc.resize(group * dim);
    for (int64_t i; claims.next(i);) {
      const int64_t b = i / kv_heads, h = i % kv_heads, r = rows.row[b];
      const Task<T> task{qp + r * q.stride(0) + h * group * q.stride(1), q.stride(1),
                         kp + h * slots * dim, vp + h * slots * dim, rows.table + b * rows.width,
                         rows.lo[b], rows.hi[b],
                         op + r * out.stride(0) + h * group * out.stride(1), out.stride(1)};
#ifdef STEP14_AVX512
      if (vector) {
        attend_recipe(task, s, *scratch);
        continue;
      }
#endif
      attend_plain(task, s, scores.data(), query.data(), acc.data());
    }
  });
}

}  // namespace

// Heads, head size and block size every kernel divides and indexes by: q [T, H, D] over pools
// [KVH, slots, D] with H a positive multiple of KVH, a positive block size.
static void check_heads(const char* name, const at::Tensor& q, const at::Tensor& pool_k, int64_t block_size) {
  const int64_t heads = q.size(1), kv_heads = pool_k.size(0), dim = q.size(2);
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0 && dim > 0 && pool_k.size(2) == dim, name,
              ": q's heads (", heads, ") a positive multiple of the pool's KV heads (", kv_heads,
              "), one head size (", dim, " and ", pool_k.size(2), ")");
  TORCH_CHECK(block_size > 0, name, ": block size ", block_size);
}

// q, out [T, H, D] (last dim contiguous); pool_k, pool_v [KVH, slots, D]; rows [B] (the query
// token of each decode row); tables [B, blocks]; lo, hi [B] (visible key positions); all int64.
// Writes out[rows] and returns out. vector=false takes the plain loops even where AVX-512 is
// there (so a test covers the path other machines take).
at::Tensor decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v,
                               at::Tensor rows, at::Tensor tables, at::Tensor lo,
                               at::Tensor hi, int64_t block_size, double scale, at::Tensor out,
                               bool vector) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && pool_k.dim() == 3 && pool_k.sizes() == pool_v.sizes(),
              "decode_attention: q, out [T, H, D] and pools [KVH, slots, D]");
  TORCH_CHECK(q.scalar_type() == pool_k.scalar_type() && pool_k.scalar_type() == pool_v.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "decode_attention: one dtype for q, out and the pools");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "decode_attention: float32, bfloat16 or float16 (its softmax is float32)");
  TORCH_CHECK(pool_k.is_contiguous() && pool_v.is_contiguous() && q.stride(2) == 1 && out.stride(2) == 1,
              "decode_attention: contiguous pools and head rows");
  TORCH_CHECK(q.device().is_cpu() && pool_k.device().is_cpu() && pool_v.device().is_cpu() && out.device().is_cpu(),
              "decode_attention runs on CPU");
  check_heads("decode_attention", q, pool_k, block_size);
  for (const auto& index : {rows, tables, lo, hi})
    TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.device().is_cpu(),
                "decode_attention: rows, tables, lo and hi are contiguous int64 CPU tensors");
  const int64_t batch = rows.numel(), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lo.numel() == batch && hi.numel() == batch,
              "decode_attention: one table, lo and hi per row");
  const int64_t group = heads / kv_heads, width = tables.size(1);
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* lo_p = lo.data_ptr<int64_t>();
  const int64_t* hi_p = hi.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= row_p[b] && row_p[b] < q.size(0), "decode_attention: row out of range");
    TORCH_CHECK(0 <= lo_p[b] && lo_p[b] < hi_p[b] && hi_p[b] <= width * block_size,
                "decode_attention: visible positions outside the block table");
    for (int64_t j = 0; j < (hi_p[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(0 <= tab[b * width + j] && (tab[b * width + j] + 1) * block_size <= slots,
                  "decode_attention: block id outside the pool");
    longest = std::max(longest, hi_p[b] - lo_p[b]);
  }
  const Shape shape{block_size, group, dim, static_cast<float>(scale)};
  const Rows decode_rows{row_p, tab, width, lo_p, hi_p, batch, longest};
  switch (q.scalar_type()) {
    case at::kFloat: attend_rows<float>(q, pool_k, pool_v, out, decode_rows, shape, vector); break;
    case at::kBFloat16: attend_rows<c10::BFloat16>(q, pool_k, pool_v, out, decode_rows, shape, vector); break;
    default: attend_rows<c10::Half>(q, pool_k, pool_v, out, decode_rows, shape, vector); break;
  }
  return out;
}

// ============================================================================= prefill
//
// Prompt chunks over the paged pool: each chunk's queries attend causally (and within a
// sliding window, if any) to its sequence's keys, cached prefix included, read from the
// blocks. One task is a tile of up to 16 query rows (positions x the query heads of one KV
// head) that read each group of keys once, every row by the row recipe.

namespace {

#ifdef STEP14_AVX512
struct PrefillShape {
  int64_t block_size, group, dim, window;  // window 0: none
  float scale;
};

// A tile: query positions [first, first + count) of one chunk, the heads of KV head kv_head.
struct Tile {
  int64_t chunk, kv_head, first, count;
};

// The chunks of one call.
struct Chunks {
  const int64_t *first_token, *start, *length, *table;
  int64_t width;
};

// Row r of a tile: position first + r / g, query head kv_head * g + r % g.
template <typename T>
void prefill_tile(const T* q, int64_t q_row_stride, int64_t q_head_stride, const T* pool_k, const T* pool_v,
                  T* out, int64_t out_row_stride, int64_t out_head_stride, const Chunks& ch, const Tile& tile,
                  const PrefillShape& s, RowScratch& scratch) {
  const int64_t g = s.group, start = ch.start[tile.chunk], token0 = ch.first_token[tile.chunk];
  RowSet rs = scratch.start(static_cast<int>(tile.count * g), s.scale);
  int64_t from = INT64_MAX, to = 0;
  for (int r = 0; r < rs.n; ++r) {
    const int64_t pos = tile.first + r / g, head = tile.kv_head * g + r % g;
    scale_query(q + (token0 + pos - start) * q_row_stride + head * q_head_stride, s.dim, s.scale, rs.qs + r * rs.width);
    scratch.lo[r] = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
    scratch.hi[r] = pos + 1;
    from = std::min(from, scratch.lo[r]);
    to = std::max(to, scratch.hi[r]);
  }
  rows_over_keys(rs, pool_k, pool_v, ch.table + tile.chunk * ch.width, from, to, s.block_size, s.dim, scratch);
  for (int r = 0; r < rs.n; ++r) {
    const int64_t pos = tile.first + r / g, head = tile.kv_head * g + r % g;
    write_row(rs.acc + r * rs.width, rs.run_sum[r], s.dim,
              out + (token0 + pos - start) * out_row_stride + head * out_head_stride);
  }
}

// ----------------------------------------------------------------------------- shared-prefix decode
//
// Decode rows that all hold the same leading blocks: a tile holds the query heads of up to
// 16 / group rows, so the shared keys are read once per tile and scored for all of them; each
// row's own keys then continue its rows' state. Shared keys end on a block boundary, where a
// group ends too, so every row is computed exactly as the decode kernel computes it.
template <typename T>
void shared_decode_rows(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v, at::Tensor& out,
                        const Rows& rows, int64_t shared_keys, const PrefillShape& ps) {
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1), dim = ps.dim, g = ps.group;
  const int64_t per_tile = KEYS / g, tiles_per_head = (rows.count + per_tile - 1) / per_tile;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t n = kv_heads * tiles_per_head;
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    RowScratch scratch(dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = i / tiles_per_head, b0 = (i % tiles_per_head) * per_tile;
      const int64_t seqs = std::min(per_tile, rows.count - b0);
      const T* k_head = kp + h * slots * dim;
      const T* v_head = vp + h * slots * dim;
      RowSet rs = scratch.start(static_cast<int>(seqs * g), ps.scale);
      for (int r = 0; r < rs.n; ++r) {
        const int64_t b = b0 + r / g;
        scale_query(qp + rows.row[b] * q.stride(0) + (h * g + r % g) * q.stride(1), dim, ps.scale, rs.qs + r * rs.width);
        scratch.lo[r] = 0;
        scratch.hi[r] = rows.hi[b];
      }
      rows_over_keys(rs, k_head, v_head, rows.table + b0 * rows.width, 0, shared_keys, ps.block_size, dim, scratch);
      for (int64_t j = 0; j < seqs; ++j) {
        const int64_t b = b0 + j;
        RowSet own = rs.rows(static_cast<int>(j * g), static_cast<int>(g));
        rows_over_keys(own, k_head, v_head, rows.table + b * rows.width, shared_keys, rows.hi[b], ps.block_size, dim,
                       scratch);
        for (int r = 0; r < own.n; ++r)
          write_row(own.acc + r * own.width, own.run_sum[r], dim,
                    op + rows.row[b] * out.stride(0) + (h * g + r) * out.stride(1));
      }
    }
  }
}

template <typename T>
void prefill_tiles(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v, at::Tensor& out,
                   const Chunks& ch, const std::vector<Tile>& tiles, const PrefillShape& s) {
  const int64_t slots = pool_k.size(1), dim = s.dim;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(tiles.size());
  // Causal tiles differ in cost (a late tile sees more keys): hand them out one at a time.
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    RowScratch scratch(dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Tile& t = tiles[i];
      prefill_tile<T>(qp, q.stride(0), q.stride(1), kp + t.kv_head * slots * dim, vp + t.kv_head * slots * dim,
                      op, out.stride(0), out.stride(1), ch, t, s, scratch);
    }
  }
}
#endif

}  // namespace

bool prefill_attention_available() {
#ifdef STEP14_AVX512
  return true;
#else
  return false;
#endif
}

// The tensor checks every tile kernel's entry point shares.
static void check_tile_inputs(const char* name, const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v,
                       const at::Tensor& out, std::initializer_list<at::Tensor> indices) {
  TORCH_CHECK(prefill_attention_available(), name, ": built without AVX-512");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1 &&
              pool_k.dim() == 3 && pool_k.sizes() == pool_v.sizes() && pool_k.is_contiguous() &&
              pool_v.is_contiguous(), name, ": q, out [T, H, D] (rows contiguous), pools [KVH, slots, D]");
  TORCH_CHECK(q.scalar_type() == pool_k.scalar_type() && pool_k.scalar_type() == pool_v.scalar_type() &&
              out.scalar_type() == q.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf),
              name, ": one dtype, float32, bfloat16 or float16");
  TORCH_CHECK(q.device().is_cpu() && pool_k.device().is_cpu() && pool_v.device().is_cpu() && out.device().is_cpu(),
              name, " runs on CPU");
  for (const auto& index : indices)
    TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.device().is_cpu(),
                name, ": contiguous int64 CPU index tensors");
}

// q, out [T, H, D] (last dim contiguous); pool_k, pool_v [KVH, slots, D]; per chunk (int64): its first
// token in q, its first position, its length, its block table row [C, blocks]; window 0 for
// full attention. Writes the chunks' rows of out and returns out.
at::Tensor prefill_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor first_token,
                             at::Tensor starts, at::Tensor lengths, at::Tensor tables, int64_t block_size,
                             double scale, int64_t window, at::Tensor out) {
  check_tile_inputs("prefill_attention", q, pool_k, pool_v, out, {first_token, starts, lengths, tables});
  const int64_t num_chunks = first_token.numel(), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1);
  check_heads("prefill_attention", q, pool_k, block_size);
  TORCH_CHECK(window >= 0, "prefill_attention: window ", window, " (0: none)");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(group <= 16, "prefill_attention: at most 16 query heads per KV head");
  TORCH_CHECK(starts.numel() == num_chunks && lengths.numel() == num_chunks && tables.dim() == 2 &&
              tables.size(0) == num_chunks, "prefill_attention: one start, length and table per chunk");
  const int64_t width = tables.size(1);
  const int64_t *ft = first_token.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>();
  const int64_t *ln = lengths.data_ptr<int64_t>(), *tab = tables.data_ptr<int64_t>();
#ifdef STEP14_AVX512  // Tile and the tile kernels exist only there (a plain build compiles without them)
  std::vector<Tile> tiles;
  const int64_t per_tile = KEYS / group;  // query positions per tile
  for (int64_t c = 0; c < num_chunks; ++c) {
    TORCH_CHECK(ln[c] > 0 && st[c] >= 0 && ft[c] >= 0 && ft[c] + ln[c] <= q.size(0) &&
                st[c] + ln[c] <= width * block_size, "prefill_attention: chunk outside q or its block table");
    // The tiles hold positions, and position + window, in int32 lanes.
    TORCH_CHECK(st[c] + ln[c] + window <= INT32_MAX, "prefill_attention: positions past int32");
    for (int64_t j = 0; j < (st[c] + ln[c] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(0 <= tab[c * width + j] && (tab[c * width + j] + 1) * block_size <= slots,
                  "prefill_attention: block id outside the pool");
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t p = 0; p < ln[c]; p += per_tile)
        tiles.push_back(Tile{c, h, st[c] + p, std::min(per_tile, ln[c] - p)});
  }
  // The costliest (latest) tiles first, so the dynamic schedule ends evenly.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.first > b.first; });
  const Chunks chunks{ft, st, ln, tab, width};
  const PrefillShape shape{block_size, group, dim, window, static_cast<float>(scale)};
  switch (q.scalar_type()) {
    case at::kFloat: prefill_tiles<float>(q, pool_k, pool_v, out, chunks, tiles, shape); break;
    case at::kBFloat16: prefill_tiles<c10::BFloat16>(q, pool_k, pool_v, out, chunks, tiles, shape); break;
    default: prefill_tiles<c10::Half>(q, pool_k, pool_v, out, chunks, tiles, shape); break;
  }
#endif
  return out;
}

// Decode rows whose block tables all begin with the same ``shared_blocks`` blocks (full
// attention): q, out [T, H, D]; rows [B] the query token of each; tables [B, blocks]; hi [B]
// context lengths (each > the shared keys). Writes out[rows] and returns out.
at::Tensor shared_decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor rows,
                                   at::Tensor tables, at::Tensor hi, int64_t shared_blocks, int64_t block_size,
                                   double scale, at::Tensor out) {
  check_tile_inputs("shared_decode_attention", q, pool_k, pool_v, out, {rows, tables, hi});
  const int64_t batch = rows.numel(), heads = q.size(1), dim = q.size(2), kv_heads = pool_k.size(0);
  const int64_t slots = pool_k.size(1);
  check_heads("shared_decode_attention", q, pool_k, block_size);
  TORCH_CHECK(heads / kv_heads <= 16, "shared_decode_attention: at most 16 query heads per KV head");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && hi.numel() == batch && batch > 0,
              "shared_decode_attention: one table and hi per row");
  const int64_t width = tables.size(1), shared_keys = shared_blocks * block_size;
  const int64_t *row_p = rows.data_ptr<int64_t>(), *hi_p = hi.data_ptr<int64_t>(), *tab = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= row_p[b] && row_p[b] < q.size(0), "shared_decode_attention: row out of range");
    TORCH_CHECK(shared_keys < hi_p[b] && hi_p[b] <= width * block_size && shared_blocks > 0,
                "shared_decode_attention: context not past the shared blocks or outside its table");
    for (int64_t j = 0; j < (hi_p[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(0 <= tab[b * width + j] && (tab[b * width + j] + 1) * block_size <= slots &&
                  (j >= shared_blocks || tab[b * width + j] == tab[j]),
                  "shared_decode_attention: block id outside the pool, or shared blocks not shared");
  }
#ifdef STEP14_AVX512
  const Rows decode_rows{row_p, tab, width, nullptr, hi_p, batch, 0};
  const PrefillShape shape{block_size, heads / kv_heads, dim, 0, static_cast<float>(scale)};
  switch (q.scalar_type()) {
    case at::kFloat: shared_decode_rows<float>(q, pool_k, pool_v, out, decode_rows, shared_keys, shape); break;
    case at::kBFloat16: shared_decode_rows<c10::BFloat16>(q, pool_k, pool_v, out, decode_rows, shared_keys, shape); break;
    default: shared_decode_rows<c10::Half>(q, pool_k, pool_v, out, decode_rows, shared_keys, shape); break;
  }
#endif
  return out;
}
