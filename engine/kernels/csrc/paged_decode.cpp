// Paged decode attention for CPUs: one query token per sequence, keys and
// values read in place from the paged KV cache through each sequence's block
// table (no gather). Work is split over (sequence, kv head) pairs with torch's
// own thread pool; the query heads that share a KV head are processed together
// so every K/V row is loaded once. Accumulation is in float32. bfloat16 on a CPU
// with AVX512_BF16 takes attend_one_bf16 (vdpbf16ps for Q·Kᵀ and, with the
// probabilities rounded to bf16, for P·V), which also prefetches the whole block
// after next into L2: 1.6-1.9x the float32-math path at 64 sequences x 320 tokens
// with the cache cold, as in a decode step (AMD EPYC, 2 cores).
#include <ATen/ATen.h>  // not torch/extension.h (pybind11, the C++ frontend): ~17 s less to compile; bindings.cpp has it
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx512_math.h"

namespace {

template <typename T>
inline void load_row(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* __restrict__ src, float* __restrict__ dst,
                                    int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

#if defined(__AVX512F__)
using namespace splitserve_kernels;

// The sums of 16 vectors as one vector: out[j] = sum of a[j]'s 16 floats. A
// transpose-and-add tree: about 3 instructions per vector instead of a full
// horizontal reduction each.
inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // lanes: [a2i.l0+l2, a2i.l1+l3, a2i+1.l0+l2, a2i+1.l1+l3]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane L: four partial sums of a[4i + L]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 2, 3, 2)));
  // r[4L + p] holds the sum of a[4p + L]: put it at index 4p + L.
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, r);
}

// One (sequence, kv head) with head_dim = 16 * NC, vectorised over head_dim; the
// cache is walked block by block (no division per token). Scores are computed 16
// tokens at a time where a block has 16 left.
// qf: [group][16 * NC] floats (pre-scaled); scores: [group][len] scratch; acc: output [group][16 * NC].
// Ask for the next block's rows of this head ahead of use: blocks sit at random
// places in the cache, so the hardware prefetcher cannot follow from one to the next.
template <typename T, int NC>
inline void prefetch_block(const T* rows, int64_t n, int64_t tok_stride) {
  constexpr int64_t kLines = (16 * NC * sizeof(T) + 63) / 64;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t l = 0; l < kLines; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * tok_stride) + 64 * l, _MM_HINT_T0);
}

template <typename T, int NC>
void attend_one(const float* qf, int64_t group, const T* kp, const T* vp, const int64_t* table, int64_t len,
                int64_t block_size, int64_t blk_stride, int64_t tok_stride, int64_t head_off, float* scores,
                float* acc) {
  // This head's rows in the block holding token `base` of `cache`; the next block's
  // rows are prefetched on the way.
  auto enter_block = [&](const T* cache, int64_t base) {
    const int64_t b = base / block_size;
    if (base + block_size < len)
      prefetch_block<T, NC>(cache + table[b + 1] * blk_stride + head_off,
                            std::min(block_size, len - base - block_size), tok_stride);
    return cache + table[b] * blk_stride + head_off;
  };
  for (int64_t base = 0; base < len; base += block_size) {
    const T* kb = enter_block(kp, base);
    const int64_t n = std::min(block_size, len - base);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      for (int64_t g = 0; g < group; ++g) {
        __m512 q[NC], a[16];
        for (int c = 0; c < NC; ++c) q[c] = _mm512_loadu_ps(qf + g * 16 * NC + 16 * c);
        for (int j = 0; j < 16; ++j) {
          const T* kr = kb + (t + j) * tok_stride;
          a[j] = _mm512_mul_ps(q[0], load16(kr));
          for (int c = 1; c < NC; ++c) a[j] = _mm512_fmadd_ps(q[c], load16(kr + 16 * c), a[j]);
        }
        _mm512_storeu_ps(scores + g * len + base + t, reduce16(a));
      }
    }
    for (; t < n; ++t) {
      const T* kr = kb + t * tok_stride;
      __m512 k[NC];
      for (int c = 0; c < NC; ++c) k[c] = load16(kr + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qf + g * 16 * NC), k[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * 16 * NC + 16 * c), k[c], a);
        scores[g * len + base + t] = _mm512_reduce_add_ps(a);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax_row(scores + g * len, len);
  constexpr int MAXG = 8;
  for (int64_t g0 = 0; g0 < group; g0 += MAXG) {
    const int64_t ng = std::min<int64_t>(MAXG, group - g0);
    __m512 o[MAXG][NC];
    for (int g = 0; g < MAXG; ++g)
      for (int c = 0; c < NC; ++c) o[g][c] = _mm512_setzero_ps();
    for (int64_t base = 0; base < len; base += block_size) {
      const T* vb = enter_block(vp, base);
      const int64_t n = std::min(block_size, len - base);
      for (int64_t t = 0; t < n; ++t) {
        const T* vr = vb + t * tok_stride;
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = load16(vr + 16 * c);
        for (int64_t g = 0; g < ng; ++g) {
          const __m512 p = _mm512_set1_ps(scores[(g0 + g) * len + base + t]);
          for (int c = 0; c < NC; ++c) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
        }
      }
    }
    for (int64_t g = 0; g < ng; ++g)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (g0 + g) * 16 * NC + 16 * c, o[g][c]);
  }
}
#endif

#if defined(__AVX512BF16__)
// n contiguous values from p into L2.
template <typename T>
inline void prefetch_span(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t l = 0; l < n * static_cast<int64_t>(sizeof(T)); l += 64) _mm_prefetch(c + l, _MM_HINT_T1);
}

// attend_one for bfloat16 on CPUs with AVX512_BF16 (head_dim = 32 * NC): q and the
// keys stay bf16 and vdpbf16ps multiplies and adds pairs of dims, 16 keys at a time
// (a transpose-and-add tree then sums each key's lanes); the scale is applied to the
// float32 scores. After the float32 softmax the probabilities are rounded to bf16
// (as FlashAttention does before its P·V product) so that P·V also runs on
// vdpbf16ps: two value rows interleaved into pairs (unpacklo/hi_epi16) meet the
// probability pair (p_t, p_t+1). The interleave permutes dims within each
// 128-bit lane; the output is put back in order once at the end.
// q: [group] rows, q_head_stride apart; scores: [group][len] scratch; probs:
// [group][len + 1] scratch (a zero pad for an odd count); out: [group] rows of head_dim.
template <int NC>
void attend_one_bf16(const c10::BFloat16* q, int64_t q_head_stride, int64_t group, const c10::BFloat16* kp,
                     const c10::BFloat16* vp, const int64_t* table, int64_t len, int64_t block_size,
                     int64_t blk_stride, int64_t tok_stride, int64_t head_off, float scale, float* scores,
                     uint16_t* probs, c10::BFloat16* out, int64_t out_head_stride) {
  using T = c10::BFloat16;
  auto enter_block = [&](const T* cache, int64_t base) {
    const int64_t b = base / block_size;
    if (base + block_size < len)
      prefetch_block<T, 2 * NC>(cache + table[b + 1] * blk_stride + head_off,
                                std::min(block_size, len - base - block_size), tok_stride);
    if (head_off == 0 && base + 2 * block_size < len)  // the whole block after, every head, into L2
      prefetch_span(cache + table[b + 2] * blk_stride, std::min(block_size, len - base - 2 * block_size) * tok_stride);
    return cache + table[b] * blk_stride + head_off;
  };
  auto load_bh = [](const T* p) { return (__m512bh)_mm512_loadu_si512(p); };
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t base = 0; base < len; base += block_size) {
    const T* kb = enter_block(kp, base);
    const int64_t n = std::min(block_size, len - base);
    for (int64_t t = 0; t < n; t += 16) {
      const int64_t m = std::min<int64_t>(16, n - t);
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
      for (int64_t g = 0; g < group; ++g) {
        __m512bh qg[NC];
        for (int c = 0; c < NC; ++c) qg[c] = load_bh(q + g * q_head_stride + 32 * c);
        __m512 a[16];
        for (int j = 0; j < 16; ++j) {
          a[j] = _mm512_setzero_ps();
          if (j >= m) continue;
          const T* kr = kb + (t + j) * tok_stride;
          for (int c = 0; c < NC; ++c) a[j] = _mm512_dpbf16_ps(a[j], qg[c], load_bh(kr + 32 * c));
        }
        _mm512_mask_storeu_ps(scores + g * len + base + t, mask, _mm512_mul_ps(reduce16(a), vscale));
      }
    }
  }
  const int64_t pstride = len + 1;
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    softmax_row(sg, len);
    uint16_t* pg = probs + g * pstride;
    int64_t t = 0;
    for (; t + 16 <= len; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sg + t)));
    for (; t < len; ++t) pg[t] = c10::BFloat16(sg[t]).x;
    pg[len] = 0;
  }
  // P·V, MAXG query heads at a time: 2 * NC accumulators each, in pair-interleaved dim order.
  constexpr int MAXG = NC == 2 ? 4 : 2;
  for (int64_t g0 = 0; g0 < group; g0 += MAXG) {
    const int64_t ng = std::min<int64_t>(MAXG, group - g0);
    __m512 o[MAXG][2 * NC];
    for (int g = 0; g < MAXG; ++g)
      for (int c = 0; c < 2 * NC; ++c) o[g][c] = _mm512_setzero_ps();
    for (int64_t base = 0; base < len; base += block_size) {
      const T* vb = enter_block(vp, base);
      const int64_t n = std::min(block_size, len - base);
      for (int64_t t = 0; t < n; t += 2) {
        const T* r0 = vb + t * tok_stride;
        __m512bh v[2 * NC];
        for (int c = 0; c < NC; ++c) {
          const __m512i a = _mm512_loadu_si512(r0 + 32 * c);
          const __m512i b = t + 1 < n ? _mm512_loadu_si512(r0 + tok_stride + 32 * c) : _mm512_setzero_si512();
          v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
          v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int64_t g = 0; g < ng; ++g) {
          uint32_t pair;
          std::memcpy(&pair, probs + (g0 + g) * pstride + base + t, sizeof(pair));
          if (t + 1 >= n) pair &= 0xFFFFu;  // the pad row is zero; keep its weight zero too
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          for (int c = 0; c < 2 * NC; ++c) o[g][c] = _mm512_dpbf16_ps(o[g][c], pp, v[c]);
        }
      }
    }
    // o[g][2c] holds dims 32c + {0-3, 8-11, 16-19, 24-27}, o[g][2c+1] the other four of each eight.
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < ng; ++g) {
      T* dst = out + (g0 + g) * out_head_stride;
      for (int c = 0; c < NC; ++c) {
        const __m512 first = _mm512_permutex2var_ps(o[g][2 * c], lo_idx, o[g][2 * c + 1]);
        const __m512 second = _mm512_permutex2var_ps(o[g][2 * c], hi_idx, o[g][2 * c + 1]);
        _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(second, first));
      }
    }
  }
}
#endif

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens,
                   at::Tensor& out, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t tok_stride = kv_heads * head_dim;           // between tokens of one block
  const int64_t blk_stride = block_size * tok_stride;       // between blocks
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row(head_dim), acc(group * head_dim), scores;
    std::vector<uint16_t> probs;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, h = work % kv_heads;
      const int64_t len = lens[s];
      const int64_t* table = bt + s * max_blocks;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (head_dim == 64 || head_dim == 128) {
          scores.resize(group * len);
          probs.resize(group * (len + 1));
          if (h == 0 && s + 1 < num_seqs)  // the next sequence's first two blocks, every head, into L2
            for (int64_t b = 0; b < 2 && b * block_size < lens[s + 1]; ++b)
              for (const T* cache : {kp, vp})
                prefetch_span(cache + bt[(s + 1) * max_blocks + b] * blk_stride,
                              std::min(block_size, lens[s + 1] - b * block_size) * tok_stride);
          auto f = head_dim == 64 ? attend_one_bf16<2> : attend_one_bf16<4>;
          f(qp + s * q_seq_stride + h * group * q_head_stride, q_head_stride, group, kp, vp, table, len,
            block_size, blk_stride, tok_stride, h * head_dim, static_cast<float>(scale), scores.data(),
            probs.data(), op + (s * num_heads + h * group) * head_dim, head_dim);
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < group; ++g) {
        load_row<T>(qp + s * q_seq_stride + (h * group + g) * q_head_stride, qf.data() + g * head_dim,
                    head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= static_cast<float>(scale);
      }
      scores.resize(group * len);
#if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128) {
        auto f = head_dim == 64 ? attend_one<T, 4> : attend_one<T, 8>;
        f(qf.data(), group, kp, vp, table, len, block_size, blk_stride, tok_stride, h * head_dim,
          scores.data(), acc.data());
        for (int64_t g = 0; g < group; ++g) {
          T* o = op + (s * num_heads + h * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < len; ++t) {
        const T* kr = kp + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + h * head_dim;
        load_row<T>(kr, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          scores[g * len + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vr = vp + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + h * head_dim;
        load_row<T>(vr, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = op + (s * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// q: [num_seqs, num_heads, head_dim] (rows may be strided); caches:
// [num_blocks, block_size, kv_heads, head_dim] contiguous; block_tables:
// [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64 (>= 1).
// Returns [num_seqs, num_heads, head_dim].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [seqs, heads, head_dim] with unit stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of kv_heads");
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<c10::BFloat16>(q, k_cache, v_cache, bt, lens, out, scale);
  } else if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q, k_cache, v_cache, bt, lens, out, scale);
  } else if (q.scalar_type() == at::kHalf) {
    decode_kernel<c10::Half>(q, k_cache, v_cache, bt, lens, out, scale);
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}
