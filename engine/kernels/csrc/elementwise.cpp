// Fused elementwise kernels for the CPU decoder layer, each reading and writing its
// tensors once instead of once per torch op. Arithmetic in float32, results rounded
// to the input dtype at the same points as the reference models (so a bf16 model
// computes what its torch ops compute):
// - add_rms_norm: residual add + RMSNorm (any float dtype; AVX-512 for bf16);
// - rope_and_cache: rotary (NeoX halves) on q and k of the fused projection, k and
//   v written to the paged caches (bf16, AVX-512, head size a multiple of 32);
// - silu_mul: SiLU(gate) * up of the fused gate/up projection (bf16, AVX-512);
// - argmax_rows: each row's first index of its largest value (greedy sampling
//   straight from the logits in the model's dtype; torch's argmax is scalar here).
#include <ATen/ATen.h>  // not torch/extension.h (pybind11, the C++ frontend): ~17 s less to compile; bindings.cpp has it
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx512_math.h"

namespace {

template <typename T>
void add_rms_norm_kernel(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      float ss = 0.f;
      if (delta != nullptr) {
        const T* dr = delta + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const T v = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
          xr[i] = v;
          const float f = static_cast<float>(v);
          ss += f * f;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; ++i) {
          const float f = static_cast<float>(xr[i]);
          ss += f * f;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

#if defined(__AVX512F__)
using splitserve_kernels::load16;  // bf16 -> float32, 16 values

// float32 -> bf16 for 16 values; rounding to nearest even, as c10::BFloat16 does
// for finite values (residual streams hold no NaN).
inline __m512i bf16_round_bits(__m512 f) {  // float32 bits rounded to bf16 precision (low half garbage)
  const __m512i b = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}
inline __m512 bf16_round(__m512 f) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_round_bits(f), _mm512_set1_epi32(0xFFFF0000)));
}
inline void bf16_store(c10::BFloat16* p, __m512 f) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(f), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

// The bf16 kernel, 16 lanes at a time (dim % 16 == 0); same rounding points as above.
void add_rms_norm_bf16(c10::BFloat16* x, const c10::BFloat16* delta, const c10::BFloat16* w,
                       c10::BFloat16* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* xr = x + r * dim;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = load16(xr + i);
        if (delta != nullptr) {
          v = bf16_round(_mm512_add_ps(v, load16(delta + r * dim + i)));
          bf16_store(xr + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
      c10::BFloat16* o = out + r * dim;
      for (int64_t i = 0; i < dim; i += 16) {
        const __m512 normed = bf16_round(_mm512_mul_ps(load16(xr + i), inv));
        bf16_store(o + i, _mm512_mul_ps(load16(w + i), normed));
      }
    }
  });
}

// rotate one head row (NeoX halves, half % 16 == 0) as torch's bf16 ops round it:
// out1 = x1*c1 + (-x2)*s1, out2 = x2*c2 + x1*s2, each product and the sum rounded.
inline void rope_row_bf16(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin,
                          int64_t half, c10::BFloat16* out, c10::BFloat16* out2) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
    const __m512 c1 = load16(cos + i), c2 = load16(cos + half + i);
    const __m512 s1 = load16(sin + i), s2 = load16(sin + half + i);
    const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
    const __m512 a = bf16_round(_mm512_add_ps(bf16_round(_mm512_mul_ps(x1, c1)), bf16_round(_mm512_mul_ps(neg_x2, s1))));
    const __m512 b = bf16_round(_mm512_add_ps(bf16_round(_mm512_mul_ps(x2, c2)), bf16_round(_mm512_mul_ps(x1, s2))));
    bf16_store(out + i, a);
    bf16_store(out + half + i, b);
    if (out2 != nullptr) {
      bf16_store(out2 + i, a);
      bf16_store(out2 + half + i, b);
    }
  }
}

// sigmoid(x) = 1 / (1 + e^-x), from e^-|x| so the exponential never overflows.
inline __m512 sigmoid512(__m512 x) {
  const __m512 e = splitserve_kernels::exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);  // in [1, 2]: 1/d by estimate + one Newton step
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), r, e);
}
#endif

template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

}  // namespace

// RMSNorm of x [rows, dim] into a new tensor; with delta, first x += delta (in place)
// and normalise the sum (the residual stream).
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must match x's last dimension and dtype");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto out = at::empty_like(x);
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kBFloat16 && x.size(1) % 16 == 0) {
    using B = c10::BFloat16;
    add_rms_norm_bf16(x.data_ptr<B>(), d.defined() ? d.data_ptr<B>() : nullptr, weight.data_ptr<B>(),
                      out.data_ptr<B>(), x.size(0), x.size(1), static_cast<float>(eps));
    return out;
  }
#endif
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_kernel<T>(x.data_ptr<T>(), d.defined() ? d.data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                           out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

#if defined(__AVX512F__)
// qkv: [T, (H + 2 KVH) D] bf16 rows (unit inner stride); cos, sin: [T, D] bf16 (any
// [T, 1, D] view of them); caches [blocks, block_size, KVH, D] contiguous; slots: [T]
// int64 flat cache slots. Returns q [T, H, D] and k [T, KVH, D] rotated (k also
// written to k_cache) and v, a view of qkv (written to v_cache).
std::vector<at::Tensor> rope_and_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                          at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                                          int64_t num_heads, int64_t num_kv_heads) {
  using B = c10::BFloat16;
  const int64_t T = qkv.size(0), D = k_cache.size(-1), half = D / 2;
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 2 && qkv.stride(1) == 1,
              "qkv must be bf16 [T, (H + 2 KVH) D] with unit inner stride");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D && D % 32 == 0, "head size must be a multiple of 32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && k_cache.size(-2) == num_kv_heads,
              "caches must be contiguous bf16 [blocks, block_size, KVH, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "slot_mapping must be int64 [T]");
  auto c = cos.reshape({T, D}).contiguous(), sn = sin.reshape({T, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kBFloat16 && sn.scalar_type() == at::kBFloat16, "cos/sin must be bf16");
  auto sl = slots.contiguous();
  auto q = at::empty({T, num_heads, D}, qkv.options());
  auto k = at::empty({T, num_kv_heads, D}, qkv.options());
  const B* x = qkv.data_ptr<B>();
  const int64_t row = qkv.stride(0), kv_row = num_kv_heads * D;
  const B *cp = c.data_ptr<B>(), *sp = sn.data_ptr<B>();
  const int64_t* slot = sl.data_ptr<int64_t>();
  B *qp = q.data_ptr<B>(), *kp = k.data_ptr<B>(), *kc = k_cache.data_ptr<B>(), *vc = v_cache.data_ptr<B>();
  const int64_t cache_slots = k_cache.numel() / kv_row;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < cache_slots, "slot out of range");
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const B* xt = x + t * row;
      const B *ct = cp + t * D, *st = sp + t * D;
      for (int64_t h = 0; h < num_heads; ++h) rope_row_bf16(xt + h * D, ct, st, half, qp + (t * num_heads + h) * D, nullptr);
      B* kdst = kc + slot[t] * kv_row;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        rope_row_bf16(xt + (num_heads + h) * D, ct, st, half, kp + t * kv_row + h * D, kdst + h * D);
      std::memcpy(vc + slot[t] * kv_row, xt + (num_heads + num_kv_heads) * D, kv_row * sizeof(B));
    }
  });
  auto v = qkv.narrow(1, (num_heads + num_kv_heads) * D, kv_row).view({T, num_kv_heads, D});
  return {q, k, v};
}

// gate_up: [T, 2I] bf16, contiguous, I % 16 == 0. Returns SiLU(gate) * up [T, I], with
// the SiLU rounded to bf16 before the product, as F.silu(gate) * up rounds.
at::Tensor silu_mul(at::Tensor gate_up) {
  using B = c10::BFloat16;
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.is_contiguous(),
              "gate_up must be a contiguous bf16 [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % 16 == 0, "the intermediate size must be a multiple of 16");
  auto out = at::empty({T, I}, gate_up.options());
  const B* in = gate_up.data_ptr<B>();
  B* op = out.data_ptr<B>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const B *g = in + t * 2 * I, *u = g + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 act = bf16_round(_mm512_mul_ps(x, sigmoid512(x)));
        bf16_store(op + t * I + i, _mm512_mul_ps(act, load16(u + i)));
      }
    }
  });
  return out;
}
#endif

// logits: [rows, vocab] float32, bf16 or fp16, contiguous. Returns int64 [rows]: the first
// index of each row's maximum, as torch.argmax (rows holding NaN excepted).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous [rows, vocab] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* lp = logits.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = lp + r * vocab;
        int64_t i = 0, best_i = 0;
        float best = -INFINITY;
#if defined(__AVX512F__)
        if (vocab >= 16) {  // per lane: the largest value and where it first occurs
          __m512 vbest = load16(row);
          __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
          __m512i vcur = vidx;
          const __m512i step = _mm512_set1_epi32(16);
          for (i = 16; i + 16 <= vocab; i += 16) {
            vcur = _mm512_add_epi32(vcur, step);
            const __m512 v = load16(row + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
            vbest = _mm512_mask_mov_ps(vbest, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, vcur);
          }
          alignas(64) float bv[16];
          alignas(64) int32_t bi[16];
          _mm512_store_ps(bv, vbest);
          _mm512_store_si512(bi, vidx);
          best = bv[0], best_i = bi[0];
          for (int l = 1; l < 16; ++l)
            if (bv[l] > best || (bv[l] == best && bi[l] < best_i)) best = bv[l], best_i = bi[l];
        }
#endif
        for (; i < vocab; ++i) {
          const float v = static_cast<float>(row[i]);
          if (v > best) best = v, best_i = i;
        }
        op[r] = best_i;
      }
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(float{});
  } else if (logits.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (logits.scalar_type() == at::kHalf) {
    run(c10::Half{});
  } else {
    TORCH_CHECK(false, "argmax_rows takes float32, bf16 or fp16 logits");
  }
  return out;
}

bool has_fused_bf16() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
