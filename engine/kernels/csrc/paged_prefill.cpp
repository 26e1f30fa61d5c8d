// Paged causal attention for prefill chunks on CPUs (AVX-512, head_dim 64 or 128).
//
// Each sequence brings q_len new query tokens at positions ctx_len - q_len ..
// ctx_len - 1; every key is read from the paged cache (the step's K/V are already
// written there), so a chunk after a cached prefix and a fresh prompt are the same
// case. Query token i attends keys 0 .. its position.
//
// Work items are (sequence, kv head, tile of kTile query tokens), spread over
// torch's thread pool. An item:
//   1. copies the keys its tile needs transposed (kt[d][t]: as float, or for bf16
//      with AVX512_BF16 as bf16 pairs of dims, kt[d/2][t]) and the values as float
//      rows (vf[t][d]): paid once per tile, used by kTile * group query rows;
//   2. scores 4 query rows x 32 keys at a time: for each d (or pair of dims), one
//      load of kt (two vectors) and a broadcast of each row's q (no horizontal sums);
//   3. softmaxes each row over its own causal length (float32 throughout);
//   4. accumulates P V for 4 rows x the whole head at a time, one value row
//      loaded per key for the four.
// Scores, softmax and probabilities are float32 (no rounding to bf16 before P V).
#include <ATen/ATen.h>  // not torch/extension.h (pybind11, the C++ frontend): ~17 s less to compile; bindings.cpp has it
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "avx512_math.h"

#if defined(__AVX512F__)
namespace {

using namespace splitserve_kernels;

constexpr int64_t kTile = 32;  // query tokens per work item
constexpr int kRows = 4;       // query rows per register block

struct Item {
  int64_t seq, head, first;  // first: index of the tile's first query token within the sequence
};

template <typename T>
struct Args {
  const T *q, *k, *v;
  T* out;
  const int64_t *tables, *q_starts, *q_lens, *ctx_lens;
  int64_t max_blocks, block_size, kv_heads, group, q_tok_stride, q_head_stride, tok_stride, blk_stride;
  float scale;
};

// Scores of rows [r0, r0 + kRows) against keys [0, nk) (nk a multiple of 16). The
// row count is a constant so that the accumulators stay in registers.
template <int NC>
inline void score_block(const float* qf, int64_t r0, const float* kt, int64_t ktn, int64_t nk, float* s,
                        int64_t sn) {
  constexpr int D = 16 * NC;
  int64_t t = 0;
  for (; t + 32 <= nk; t += 32) {
    __m512 a[kRows][2];
    for (int r = 0; r < kRows; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * ktn + t), k1 = _mm512_loadu_ps(kt + d * ktn + t + 16);
      for (int r = 0; r < kRows; ++r) {
        const __m512 qd = _mm512_set1_ps(qf[(r0 + r) * D + d]);
        a[r][0] = _mm512_fmadd_ps(qd, k0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(qd, k1, a[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(s + (r0 + r) * sn + t, a[r][0]);
      _mm512_storeu_ps(s + (r0 + r) * sn + t + 16, a[r][1]);
    }
  }
  for (; t < nk; t += 16) {
    __m512 a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * ktn + t);
      for (int r = 0; r < kRows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(r0 + r) * D + d]), k0, a[r]);
    }
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(s + (r0 + r) * sn + t, a[r]);
  }
}

#if defined(__AVX512BF16__)
// score_block for bfloat16 inputs with AVX512_BF16: q and the keys stay bf16, in
// pairs of adjacent dims (one 32-bit word; keys stored kt[pair][t]), and one
// vdpbf16ps multiplies and adds two dims for 16 keys. Sums are float32; the
// softmax scale is applied to the scores (q is not rounded after scaling).
template <int NC>
inline void score_block_pairs(const uint32_t* qw, int64_t r0, const uint32_t* kt, int64_t ktn, int64_t nk,
                              float* s, int64_t sn, float scale) {
  constexpr int P = 8 * NC;  // dim pairs per head row
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 32 <= nk; t += 32) {
    __m512 a[kRows][2];
    for (int r = 0; r < kRows; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int j = 0; j < P; ++j) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + j * ktn + t);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + j * ktn + t + 16);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[(r0 + r) * P + j]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], qj, k0);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], qj, k1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(s + (r0 + r) * sn + t, _mm512_mul_ps(a[r][0], sc));
      _mm512_storeu_ps(s + (r0 + r) * sn + t + 16, _mm512_mul_ps(a[r][1], sc));
    }
  }
  for (; t < nk; t += 16) {
    __m512 a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = _mm512_setzero_ps();
    for (int j = 0; j < P; ++j) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + j * ktn + t);
      for (int r = 0; r < kRows; ++r)
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[(r0 + r) * P + j])), k0);
    }
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(s + (r0 + r) * sn + t, _mm512_mul_ps(a[r], sc));
  }
}
constexpr bool kHasPairs = true;
#else
constexpr bool kHasPairs = false;
#endif

// Output rows [r0, r0 + kRows) = P V over keys [0, nk); p is zero past each row's length.
template <int NC>
inline void pv_block(const float* p, int64_t sn, int64_t r0, int64_t nk, const float* vf, float* o) {
  constexpr int D = 16 * NC;
  constexpr int R = NC == 4 ? kRows : kRows / 2;  // 16 accumulators at most
  for (int64_t rb = 0; rb < kRows; rb += R) {
    __m512 acc[R][NC];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nk; ++t) {
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vf + t * D + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 pr = _mm512_set1_ps(p[(r0 + rb + r) * sn + t]);
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pr, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + (r0 + rb + r) * D + 16 * c, acc[r][c]);
  }
}

template <typename T, int NC>
void attend_tile(const Args<T>& a, const Item& it, std::vector<float>& kt, std::vector<float>& vf,
                 std::vector<float>& qf, std::vector<float>& s, std::vector<float>& of) {
  constexpr int D = 16 * NC;
  // bf16 keys and queries stay in dim pairs for vdpbf16ps (in kt's and qf's storage)
  constexpr bool kPairs = kHasPairs && std::is_same_v<T, c10::BFloat16>;
  const int64_t q_len = a.q_lens[it.seq], ctx = a.ctx_lens[it.seq];
  const int64_t n = std::min(kTile, q_len - it.first);  // query tokens in this tile
  const int64_t pos0 = ctx - q_len + it.first;           // position of the first
  const int64_t nk = pos0 + n;                            // keys the last one sees
  const int64_t ktn = (nk + 15) / 16 * 16;
  const int64_t* table = a.tables + it.seq * a.max_blocks;
  kt.assign(D * ktn, 0.f);
  vf.resize(nk * D);
  const int64_t head_off = it.head * D;
  for (int64_t t = 0; t < nk; ++t) {
    const int64_t off = table[t / a.block_size] * a.blk_stride + (t % a.block_size) * a.tok_stride + head_off;
    const T* kr = a.k + off;
    const T* vr = a.v + off;
    if constexpr (kPairs) {
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(kr);
      uint32_t* ktw = reinterpret_cast<uint32_t*>(kt.data());
      for (int j = 0; j < D / 2; ++j) ktw[j * ktn + t] = kw[j];
    } else {
      for (int c = 0; c < NC; ++c) {
        float tmp[16];
        _mm512_storeu_ps(tmp, load16(kr + 16 * c));
        for (int j = 0; j < 16; ++j) kt[(16 * c + j) * ktn + t] = tmp[j];
      }
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(vf.data() + t * D + 16 * c, load16(vr + 16 * c));
  }
  // rows: query token i, head g of the group -> row i * group + g; padded with zero
  // rows to a multiple of kRows (their scores and outputs are computed, never used)
  const int64_t rows = n * a.group, padded = (rows + kRows - 1) / kRows * kRows;
  qf.assign(padded * D, 0.f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < a.group; ++g) {
      const T* qr = a.q + (a.q_starts[it.seq] + it.first + i) * a.q_tok_stride +
                    (it.head * a.group + g) * a.q_head_stride;
      if constexpr (kPairs) {
        const uint32_t* qrw = reinterpret_cast<const uint32_t*>(qr);
        uint32_t* qw = reinterpret_cast<uint32_t*>(qf.data()) + (i * a.group + g) * (D / 2);
        for (int j = 0; j < D / 2; ++j) qw[j] = qrw[j];
      } else {
        const __m512 sc = _mm512_set1_ps(a.scale);
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(qf.data() + (i * a.group + g) * D + 16 * c, _mm512_mul_ps(load16(qr + 16 * c), sc));
      }
    }
  s.assign(padded * ktn, 0.f);
  // the furthest position rows [r0, r0 + kRows) reach (padding rows count as the last token)
  auto reach = [&](int64_t r0) { return pos0 + std::min(r0 + kRows - 1, rows - 1) / a.group; };
  for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
    const int64_t nk_block = (reach(r0) + 16) / 16 * 16;
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      score_block_pairs<NC>(reinterpret_cast<const uint32_t*>(qf.data()), r0,
                            reinterpret_cast<const uint32_t*>(kt.data()), ktn, nk_block, s.data(), ktn, a.scale);
      continue;
    }
#endif
    score_block<NC>(qf.data(), r0, kt.data(), ktn, nk_block, s.data(), ktn);
  }
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t len = pos0 + std::min(r, rows - 1) / a.group + 1;
    float* sr = s.data() + r * ktn;
    softmax_row(sr, len);
    std::fill(sr + len, sr + ktn, 0.f);
  }
  of.resize(padded * D);
  for (int64_t r0 = 0; r0 < padded; r0 += kRows) pv_block<NC>(s.data(), ktn, r0, reach(r0) + 1, vf.data(), of.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < a.group; ++g) {
      T* o = a.out + ((a.q_starts[it.seq] + it.first + i) * a.kv_heads * a.group + it.head * a.group + g) * D;
      const float* src = of.data() + (i * a.group + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(src[d]);
    }
}

template <typename T, int NC>
void prefill_kernel(const Args<T>& a, int64_t num_seqs) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t h = 0; h < a.kv_heads; ++h)
      for (int64_t i = 0; i < a.q_lens[s]; i += kTile) items.push_back({s, h, i});
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, vf, qf, s, of;
    for (int64_t w = begin; w < end; ++w) attend_tile<T, NC>(a, items[w], kt, vf, qf, s, of);
  });
}

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
              const at::Tensor& ctx_lens, at::Tensor& out, double scale) {
  const int64_t kv_heads = k_cache.size(2), head_dim = q.size(2);
  Args<T> a{q.data_ptr<T>(),        k_cache.data_ptr<T>(),  v_cache.data_ptr<T>(),
            out.data_ptr<T>(),      tables.data_ptr<int64_t>(), q_starts.data_ptr<int64_t>(),
            q_lens.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), tables.size(1),
            k_cache.size(1),        kv_heads,               q.size(1) / kv_heads,
            q.stride(0),            q.stride(1),            kv_heads * head_dim,
            k_cache.size(1) * kv_heads * head_dim, static_cast<float>(scale)};
  if (head_dim == 64)
    prefill_kernel<T, 4>(a, q_lens.size(0));
  else
    prefill_kernel<T, 8>(a, q_lens.size(0));
}

}  // namespace
#endif

// q: [tokens, num_heads, head_dim] (rows may be strided); caches: [num_blocks,
// block_size, kv_heads, head_dim] contiguous, already holding this step's K/V;
// block_tables: [seqs, max_blocks] int64; q_starts, q_lens, ctx_lens: [seqs] int64
// (sequence s's new tokens are q rows q_starts[s] .. + q_lens[s], at positions
// ctx_lens[s] - q_lens[s] ..). Returns [tokens, num_heads, head_dim]; rows of q that
// no sequence covers are left uninitialised.
at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor q_starts, at::Tensor q_lens,
                            at::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "paged_prefill supports head_dim 64 and 128");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of kv_heads");
  for (const auto& t : {block_tables, q_starts, q_lens, ctx_lens})
    TORCH_CHECK(t.scalar_type() == at::kLong, "tables and lengths must be int64");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#if defined(__AVX512F__)
  auto bt = block_tables.contiguous();
  auto qs = q_starts.contiguous(), ql = q_lens.contiguous(), cl = ctx_lens.contiguous();
  if (q.scalar_type() == at::kBFloat16)
    dispatch<c10::BFloat16>(q, k_cache, v_cache, bt, qs, ql, cl, out, scale);
  else if (q.scalar_type() == at::kFloat)
    dispatch<float>(q, k_cache, v_cache, bt, qs, ql, cl, out, scale);
  else if (q.scalar_type() == at::kHalf)
    dispatch<c10::Half>(q, k_cache, v_cache, bt, qs, ql, cl, out, scale);
  else
    TORCH_CHECK(false, "unsupported dtype");
#else
  TORCH_CHECK(false, "paged_prefill needs AVX-512");
#endif
  return out;
}

// Whether paged_prefill can run here (built with AVX-512).
bool has_paged_prefill() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
