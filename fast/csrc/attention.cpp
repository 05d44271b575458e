// Decode attention over the paged KV pool: one query token per row, every query head of a KV
// head group at once, keys and values read straight from their blocks (no gather, no padding),
// softmax in float32. The same result as model.py's paged_attention for these rows.
//
// Two passes per (row, KV head): scores of every visible key, then the softmax-weighted sum of
// the values. On a CPU with AVX-512 the dots, the exp and the sums run 16 lanes wide and the
// next blocks are prefetched (blocks sit anywhere in the pool, where the hardware prefetcher
// does not follow); elsewhere the same loops in plain C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
inline void prefetch_block(const T* first_row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(first_row);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_NTA);
}

// Softmax of one query head's scores in place.
inline void softmax(float* s, int64_t count) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < count; j += LANES) {  // the last load masked too: never past s[count - 1]
    const __mmask16 m = tail_mask(count - j);
    peak = _mm512_mask_max_ps(peak, m, peak, _mm512_maskz_loadu_ps(m, s + j));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += LANES) {
    const __mmask16 m = tail_mask(count - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top));
    total = _mm512_mask_add_ps(total, m, total, e);
    _mm512_mask_storeu_ps(s + j, m, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t j = 0; j < count; j += LANES) {
    const __mmask16 m = tail_mask(count - j);
    _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv));
  }
}

// Calls each(position, row pointer) for the visible keys in order, block by block, prefetching
// the next block of the same pool.
constexpr int64_t AHEAD = 2;

template <typename T, typename Each>
inline void for_each_key(const T* pool, const Task<T>& t, const Shape& s, Each each) {
  const int64_t bs = s.block_size, row_bytes = s.dim * static_cast<int64_t>(sizeof(T));
  for (int64_t p = t.lo; p < t.hi;) {
    const int64_t blk = p / bs, end = std::min(t.hi, (blk + 1) * bs);
    if (p == t.lo)  // the first blocks, then each block AHEAD blocks before it is read
      for (int64_t a = 1; a <= AHEAD && (blk + a) * bs < t.hi; ++a)
        prefetch_block(pool + t.table[blk + a] * bs * s.dim, bs * row_bytes);
    else if ((blk + AHEAD) * bs < t.hi)
      prefetch_block(pool + t.table[blk + AHEAD] * bs * s.dim, bs * row_bytes);
    const T* row = pool + (t.table[blk] * bs + p % bs) * s.dim;
    for (; p < end; ++p, row += s.dim) each(p, row);
  }
}

// query / acc: [group, chunks * LANES] float32 (zero beyond dim); scores: [group, count].
template <typename T>
void attend_simd(const Task<T>& t, const Shape& s, float* scores, float* query, float* acc) {
  const int64_t count = t.hi - t.lo, group = s.group, dim = s.dim;
  const int64_t chunks = (dim + LANES - 1) / LANES, width = chunks * LANES;
  const __mmask16 last = tail_mask(dim - (chunks - 1) * LANES);
  auto mask = [&](int64_t c) { return c + 1 == chunks ? last : static_cast<__mmask16>(0xFFFF); };
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(query + g * width + c * LANES,
                       _mm512_mul_ps(load(t.q + g * t.q_stride + c * LANES, mask(c)), scale));
  for_each_key(t.k, t, s, [&](int64_t p, const T* row) {
    for (int64_t g = 0; g < group; ++g) {
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();  // two chains: half the latency
      int64_t c = 0;
      for (; c + 1 < chunks; c += 2) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * width + c * LANES), load(row + c * LANES, mask(c)), a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * width + (c + 1) * LANES),
                            load(row + (c + 1) * LANES, mask(c + 1)), b);
      }
      if (c < chunks)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * width + c * LANES), load(row + c * LANES, mask(c)), a);
      scores[g * count + (p - t.lo)] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  });
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * count, count);
  std::fill(acc, acc + group * width, 0.f);
  for_each_key(t.v, t, s, [&](int64_t p, const T* row) {
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 value = load(row + c * LANES, mask(c));
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * width + c * LANES;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * count + (p - t.lo)]), value,
                                            _mm512_loadu_ps(a)));
      }
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) t.out[g * t.out_stride + d] = static_cast<T>(acc[g * width + d]);
}

// Sums of four vectors' lanes: {sum a0, sum a1, sum a2, sum a3} (one transpose, not four reductions).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// attend_simd for a head size of CH x 16: keys four at a time, each converted once for up to
// GB query heads of the group, their dots summed by one transpose; the values' weighted sums
// held in registers (VB heads at a time) instead of read and written back at every key.
template <typename T, int CH, int GB, int VB>
void attend_fixed(const Task<T>& t, const Shape& s, float* scores, float* query, float* acc) {
  constexpr int64_t W = CH * LANES;
  const int64_t count = t.hi - t.lo, group = s.group;
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < CH; ++c)
      _mm512_storeu_ps(query + g * W + c * LANES, _mm512_mul_ps(load(t.q + g * t.q_stride + c * LANES, 0xFFFF), scale));
  const T* rows[4];
  int n = 0;
  auto score4 = [&](int64_t first) {  // keys first .. first + 3 (positions past lo)
    for (int64_t g0 = 0; g0 < group; g0 += GB) {
      __m512 a[GB][4];
      for (int g = 0; g < GB; ++g)
        for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
      for (int c = 0; c < CH; ++c) {
        __m512 k[4];
        for (int j = 0; j < 4; ++j) k[j] = load(rows[j] + c * LANES, 0xFFFF);
        for (int g = 0; g < GB; ++g) {
          const __m512 q = _mm512_loadu_ps(query + (g0 + g) * W + c * LANES);
          for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(q, k[j], a[g][j]);
        }
      }
      for (int g = 0; g < GB; ++g) _mm_storeu_ps(scores + (g0 + g) * count + first, sum4(a[g][0], a[g][1], a[g][2], a[g][3]));
    }
  };
  for_each_key(t.k, t, s, [&](int64_t p, const T* row) {
    rows[n++] = row;
    if (n == 4) {
      score4(p - 3 - t.lo);
      n = 0;
    }
  });
  for (int j = 0; j < n; ++j) {  // the last keys, one at a time
    const T* row = rows[j];
    const int64_t at = count - n + j;
    for (int64_t g = 0; g < group; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < CH; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * W + c * LANES), load(row + c * LANES, 0xFFFF), a);
      scores[g * count + at] = _mm512_reduce_add_ps(a);
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * count, count);
  for (int64_t g0 = 0; g0 < group; g0 += VB) {
    __m512 sum[VB][CH];
    for (int g = 0; g < VB; ++g)
      for (int c = 0; c < CH; ++c) sum[g][c] = _mm512_setzero_ps();
    for_each_key(t.v, t, s, [&](int64_t p, const T* row) {
      for (int c = 0; c < CH; ++c) {
        const __m512 value = load(row + c * LANES, 0xFFFF);
        for (int g = 0; g < VB; ++g)
          sum[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(g0 + g) * count + (p - t.lo)]), value, sum[g][c]);
      }
    });
    for (int g = 0; g < VB; ++g)
      for (int c = 0; c < CH; ++c) {
        alignas(64) float lanes[LANES];
        _mm512_store_ps(lanes, sum[g][c]);
        for (int d = 0; d < LANES; ++d) t.out[(g0 + g) * t.out_stride + c * LANES + d] = static_cast<T>(lanes[d]);
      }
  }
}

// The fixed-size kernel for this head size and group, where there is one (else nullptr).
template <typename T>
using Attend = void (*)(const Task<T>&, const Shape&, float*, float*, float*);

template <typename T, int CH>
Attend<T> fixed_for_group(int64_t group) {
  constexpr int VB = CH <= 4 ? 4 : CH <= 8 ? 2 : 1;  // the values' sums: at most 16 registers
  if (group % 4 == 0) return VB >= 4 ? attend_fixed<T, CH, 4, 4> : VB == 2 ? attend_fixed<T, CH, 4, 2> : attend_fixed<T, CH, 4, 1>;
  if (group % 2 == 0) return VB >= 2 ? attend_fixed<T, CH, 2, 2> : attend_fixed<T, CH, 2, 1>;
  return attend_fixed<T, CH, 1, 1>;
}

template <typename T>
Attend<T> fixed_kernel(const Shape& s) {
  if (s.dim % LANES) return nullptr;
  switch (s.dim / LANES) {
    case 4: return fixed_for_group<T, 4>(s.group);
    case 8: return fixed_for_group<T, 8>(s.group);
    default: return nullptr;
  }
}
#endif

template <typename T>
void attend(const Task<T>& t, const Shape& s, bool vector, float* scores, float* query, float* acc) {
#ifdef STEP14_AVX512
  if (vector) {
    if (const Attend<T> fixed = fixed_kernel<T>(s)) return fixed(t, s, scores, query, acc);
    return attend_simd(t, s, scores, query, acc);
  }
#endif
  attend_plain(t, s, scores, query, acc);
}

// The decode rows of one call: their query tokens, block tables and visible positions.
struct Rows {
  const int64_t *row, *table;
  int64_t width;
  const int64_t *lo, *hi;
  int64_t count, longest;
};

// Every (row, KV head) pair, spread over torch's threads.
template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v,
                 at::Tensor& out, const Rows& rows, const Shape& s, bool vector) {
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1), dim = s.dim, group = s.group;
  const int64_t padded = (dim + 15) / 16 * 16;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows.count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * rows.longest), query(group * padded), acc(group * padded);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads, r = rows.row[b];
      const Task<T> task{qp + r * q.stride(0) + h * group * q.stride(1), q.stride(1),
                         kp + h * slots * dim, vp + h * slots * dim, rows.table + b * rows.width,
                         rows.lo[b], rows.hi[b],
                         op + r * out.stride(0) + h * group * out.stride(1), out.stride(1)};
      attend(task, s, vector, scores.data(), query.data(), acc.data());
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
// blocks. One task is a tile of 16 query rows (positions x the query heads of one KV head)
// against every visible key, 16 keys at a time, with an online softmax. The tile is kept
// transposed -- a lane per query row -- so scores, their maxima and sums are plain vector
// ops, and keys and values enter as broadcasts: no horizontal sums.

namespace {

#ifdef STEP14_AVX512
constexpr int KEYS = 16;  // keys per group; also query rows per tile (one per lane)

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

// keys [16][dim] float32 from rows first..first+count of one block (zeros past count).
template <typename T>
inline void load_keys(const T* rows, int64_t count, int64_t dim, float* dst) {
  const int64_t chunks = (dim + LANES - 1) / LANES;
  for (int64_t k = 0; k < KEYS; ++k)
    for (int64_t c = 0; c < chunks; ++c) {
      const __mmask16 m = k < count ? tail_mask(dim - c * LANES) : static_cast<__mmask16>(0);
      _mm512_mask_storeu_ps(dst + k * dim + c * LANES, tail_mask(dim - c * LANES),
                            load(rows + k * dim + c * LANES, m));
    }
}

// The running softmax of a tile: per lane the largest score so far, the sum of exp(score -
// that), and the weighted values [dim][16] (lane-minor).
struct TileState {
  __m512 run_max, run_sum;
  float* ot;
};

// Scratch of one thread for tiles.
struct TileScratch {
  std::vector<float> qt, ot, kf, vf, probs;
  explicit TileScratch(int64_t dim) : qt(dim * KEYS), ot(dim * KEYS), kf(KEYS * dim), vf(KEYS * dim), probs(KEYS * KEYS) {}
};

// Keys [from, to) of one sequence (``table``) into the tile's state: lane r sees key p when
// p <= pos[r] and, with a window, p > pos[r] - window. qt: the scaled queries, [dim][16].
template <typename T>
void tile_over_keys(const float* qt, const T* pool_k, const T* pool_v, const int64_t* table, int64_t from,
                    int64_t to, __m512i pos, const PrefillShape& s, TileState& st, TileScratch& scratch) {
  const int64_t dim = s.dim, bs = s.block_size;
  float *kf = scratch.kf.data(), *vf = scratch.vf.data(), *probs = scratch.probs.data(), *ot = st.ot;
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t kp = from; kp < to;) {
    const int64_t blk = kp / bs, count = std::min({to - kp, static_cast<int64_t>(KEYS), (blk + 1) * bs - kp});
    const int64_t row0 = table[blk] * bs + kp % bs;
    load_keys(pool_k + row0 * dim, count, dim, kf);
    load_keys(pool_v + row0 * dim, count, dim, vf);
    __m512 sc[KEYS];
    for (int k = 0; k < KEYS; ++k) sc[k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 qd = _mm512_loadu_ps(qt + d * KEYS);
      for (int k = 0; k < KEYS; ++k) sc[k] = _mm512_fmadd_ps(_mm512_set1_ps(kf[k * dim + d]), qd, sc[k]);
    }
    __mmask16 seen[KEYS];
    __m512 top = st.run_max;
    for (int k = 0; k < KEYS; ++k) {
      const int32_t key = static_cast<int32_t>(kp + k);
      __mmask16 ok = k < count ? _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(key), _MM_CMPINT_NLT) : 0;
      if (s.window > 0)
        ok &= _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(key + static_cast<int32_t>(s.window)), _MM_CMPINT_LT);
      seen[k] = ok;
      sc[k] = _mm512_mask_mov_ps(neg_inf, ok, sc[k]);
      top = _mm512_max_ps(top, sc[k]);
    }
    const __mmask16 any = _mm512_cmp_ps_mask(top, neg_inf, _CMP_NEQ_OQ);  // lanes with a key so far
    const __m512 safe_top = _mm512_maskz_mov_ps(any, top);
    const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(st.run_max, neg_inf, _CMP_NEQ_OQ),
                                             exp_nonpositive(_mm512_sub_ps(st.run_max, safe_top)));
    __m512 total = _mm512_setzero_ps();
    for (int k = 0; k < KEYS; ++k) {
      const __m512 p = _mm512_maskz_mov_ps(seen[k], exp_nonpositive(_mm512_sub_ps(sc[k], safe_top)));
      total = _mm512_add_ps(total, p);
      _mm512_storeu_ps(probs + k * KEYS, p);
    }
    st.run_sum = _mm512_fmadd_ps(st.run_sum, alpha, total);
    st.run_max = top;
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
      __m512 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + j) * KEYS), alpha);
      for (int k = 0; k < KEYS; ++k) {
        const __m512 p = _mm512_loadu_ps(probs + k * KEYS);
        for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(vf[k * dim + d + j]), p, acc[j]);
      }
      for (int j = 0; j < 8; ++j) _mm512_storeu_ps(ot + (d + j) * KEYS, acc[j]);
    }
    for (; d < dim; ++d) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(ot + d * KEYS), alpha);
      for (int k = 0; k < KEYS; ++k)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(vf[k * dim + d]), _mm512_loadu_ps(probs + k * KEYS), acc);
      _mm512_storeu_ps(ot + d * KEYS, acc);
    }
    kp += count;
  }
}

// A fresh tile: lane r's query row q_rows[r] (nullptr: an idle lane) scaled into qt [dim][16].
template <typename T>
TileState start_tile(const T* const* q_rows, const PrefillShape& s, TileScratch& scratch) {
  for (int64_t d = 0; d < s.dim; ++d)
    for (int r = 0; r < KEYS; ++r)
      scratch.qt[d * KEYS + r] = q_rows[r] ? static_cast<float>(q_rows[r][d]) * s.scale : 0.f;
  std::fill(scratch.ot.begin(), scratch.ot.end(), 0.f);
  return TileState{_mm512_set1_ps(-INFINITY), _mm512_setzero_ps(), scratch.ot.data()};
}

template <typename T>
void prefill_tile(const T* q, int64_t q_row_stride, int64_t q_head_stride, const T* pool_k, const T* pool_v,
                  T* out, int64_t out_row_stride, int64_t out_head_stride, const Chunks& ch, const Tile& tile,
                  const PrefillShape& s, TileScratch& scratch) {
  const int64_t g = s.group, start = ch.start[tile.chunk], token0 = ch.first_token[tile.chunk];
  // Lane r: position first + r / g, query head kv_head * g + r % g; lanes past the tile: -1.
  alignas(64) int32_t lane_pos[KEYS];
  const T* q_rows[KEYS];
  for (int r = 0; r < KEYS; ++r) {
    const int64_t p = r / g;
    const bool used = p < tile.count && r < (KEYS / g) * g;
    lane_pos[r] = used ? static_cast<int32_t>(tile.first + p) : -1;
    q_rows[r] = used ? q + (token0 + tile.first + p - start) * q_row_stride + (tile.kv_head * g + r % g) * q_head_stride
                     : nullptr;
  }
  TileState st = start_tile(q_rows, s, scratch);
  const int64_t lo = s.window > 0 ? std::max<int64_t>(0, tile.first - s.window + 1) : 0;
  tile_over_keys(scratch.qt.data(), pool_k, pool_v, ch.table + tile.chunk * ch.width, lo, tile.first + tile.count,
                 _mm512_load_si512(lane_pos), s, st, scratch);
  alignas(64) float sums[KEYS];
  _mm512_store_ps(sums, st.run_sum);
  for (int r = 0; r < KEYS; ++r) {
    if (lane_pos[r] < 0) continue;
    T* row = out + (token0 + lane_pos[r] - start) * out_row_stride + (tile.kv_head * g + r % g) * out_head_stride;
    const float inv = 1.0f / sums[r];
    for (int64_t d = 0; d < s.dim; ++d) row[d] = static_cast<T>(st.ot[d * KEYS + r] * inv);
  }
}

// ----------------------------------------------------------------------------- shared-prefix decode
//
// Decode rows that all hold the same leading blocks: a tile's lanes are the query heads of up
// to 16 / group rows, so the shared keys are read once per tile and scored for all of them;
// each row's own keys then continue its lanes' softmax by dots, as the decode kernel does.

// One (row, KV head): its lanes [lane0, lane0 + group) of the tile after the shared keys; its
// own keys [t.lo, t.hi) finish the softmax; writes the group's output rows.
template <typename T>
void finish_own(const float* qt, const TileState& st, int lane0, const Task<T>& t, const Shape& s,
                std::vector<float>& scores, std::vector<float>& query, std::vector<float>& acc) {
  const int64_t count = t.hi - t.lo, group = s.group, dim = s.dim;
  const int64_t chunks = (dim + LANES - 1) / LANES, width = chunks * LANES;
  const __mmask16 last = tail_mask(dim - (chunks - 1) * LANES);
  auto mask = [&](int64_t c) { return c + 1 == chunks ? last : static_cast<__mmask16>(0xFFFF); };
  alignas(64) float shared_max[KEYS], shared_sum[KEYS];
  _mm512_store_ps(shared_max, st.run_max);
  _mm512_store_ps(shared_sum, st.run_sum);
  scores.resize(std::max<int64_t>(1, group * count));
  std::fill(query.begin(), query.end(), 0.f);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) query[g * width + d] = qt[d * KEYS + lane0 + g];  // scaled already
  for_each_key(t.k, t, s, [&](int64_t p, const T* row) {
    for (int64_t g = 0; g < group; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(query.data() + g * width + c * LANES), load(row + c * LANES, mask(c)), a);
      scores[g * count + (p - t.lo)] = _mm512_reduce_add_ps(a);
    }
  });
  std::vector<float> total(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * count;
    float top = shared_max[lane0 + g];
    for (int64_t j = 0; j < count; ++j) top = std::max(top, sg[j]);
    const float carried = std::exp(shared_max[lane0 + g] - top);
    float sum = shared_sum[lane0 + g] * carried;
    for (int64_t j = 0; j < count; ++j) sum += (sg[j] = std::exp(sg[j] - top));
    total[g] = sum;
    for (int64_t d = 0; d < width; ++d) acc[g * width + d] = d < dim ? st.ot[d * KEYS + lane0 + g] * carried : 0.f;
  }
  for_each_key(t.v, t, s, [&](int64_t p, const T* row) {
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 value = load(row + c * LANES, mask(c));
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc.data() + g * width + c * LANES;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * count + (p - t.lo)]), value, _mm512_loadu_ps(a)));
      }
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) t.out[g * t.out_stride + d] = static_cast<T>(acc[g * width + d] / total[g]);
}

template <typename T>
void shared_decode_rows(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v, at::Tensor& out,
                        const Rows& rows, int64_t shared_keys, const PrefillShape& ps) {
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1), dim = ps.dim, g = ps.group;
  const int64_t per_tile = KEYS / g, tiles_per_head = (rows.count + per_tile - 1) / per_tile;
  const Shape s{ps.block_size, g, dim, ps.scale};
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t n = kv_heads * tiles_per_head, width = (dim + LANES - 1) / LANES * LANES;
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    TileScratch scratch(dim);
    std::vector<float> scores, query(g * width), acc(g * width);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = i / tiles_per_head, b0 = (i % tiles_per_head) * per_tile;
      const int64_t seqs = std::min(per_tile, rows.count - b0);
      const T* k_head = kp + h * slots * dim;
      const T* v_head = vp + h * slots * dim;
      alignas(64) int32_t lane_pos[KEYS];
      const T* q_rows[KEYS];
      for (int r = 0; r < KEYS; ++r) {
        const bool used = r / g < seqs && r < per_tile * g;
        lane_pos[r] = used ? (1 << 30) : -1;  // every shared key is before every row's query
        q_rows[r] = used ? qp + rows.row[b0 + r / g] * q.stride(0) + (h * g + r % g) * q.stride(1) : nullptr;
      }
      TileState st = start_tile(q_rows, ps, scratch);
      tile_over_keys(scratch.qt.data(), k_head, v_head, rows.table + b0 * rows.width, 0, shared_keys,
                     _mm512_load_si512(lane_pos), ps, st, scratch);
      for (int64_t j = 0; j < seqs; ++j) {
        const int64_t b = b0 + j, r = rows.row[b];
        const Task<T> task{nullptr, 0, k_head, v_head, rows.table + b * rows.width, shared_keys, rows.hi[b],
                           op + r * out.stride(0) + h * g * out.stride(1), out.stride(1)};
        finish_own(scratch.qt.data(), st, static_cast<int>(j * g), task, s, scores, query, acc);
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
    TileScratch scratch(dim);
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
