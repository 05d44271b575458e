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
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STEP14_AVX512 1
#include <immintrin.h>
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
inline __m512 load(const c10::BFloat16* p, __mmask16 m) {  // bfloat16: a float32's top half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial, 2^n by scalef.
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

inline __mmask16 tail_mask(int64_t n) { return n >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

template <typename T>
inline void prefetch_block(const T* first_row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(first_row);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// Softmax of one query head's scores in place.
inline void softmax(float* s, int64_t count) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < count; j += LANES)
    peak = _mm512_mask_max_ps(peak, tail_mask(count - j), peak, _mm512_loadu_ps(s + j));
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
#endif

template <typename T>
void attend(const Task<T>& t, const Shape& s, bool vector, float* scores, float* query, float* acc) {
#ifdef STEP14_AVX512
  if (vector) return attend_simd(t, s, scores, query, acc);
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
  TORCH_CHECK(q.device().is_cpu() && pool_k.device().is_cpu() && out.device().is_cpu(),
              "decode_attention runs on CPU");
  for (const auto& index : {rows, tables, lo, hi})
    TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.device().is_cpu(),
                "decode_attention: rows, tables, lo and hi are contiguous int64 CPU tensors");
  const int64_t batch = rows.numel(), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool_k.size(0), slots = pool_k.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lo.numel() == batch && hi.numel() == batch,
              "decode_attention: one table, lo and hi per row");
  TORCH_CHECK(heads % kv_heads == 0 && pool_k.size(2) == dim, "decode_attention: heads and head_dim");
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
