// Fused residual add + RMSNorm for the CPU decoder layer: reads and writes the
// residual stream once instead of once per torch op. Arithmetic in float32, results
// rounded to the input dtype at the same points as the reference models.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>

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
#include <immintrin.h>

// bf16 <-> float32 for 16 values; rounding to nearest even, as c10::BFloat16 does
// for finite values (residual streams hold no NaN).
inline __m512 bf16_load(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
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
        __m512 v = bf16_load(xr + i);
        if (delta != nullptr) {
          v = bf16_round(_mm512_add_ps(v, bf16_load(delta + r * dim + i)));
          bf16_store(xr + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
      c10::BFloat16* o = out + r * dim;
      for (int64_t i = 0; i < dim; i += 16) {
        const __m512 normed = bf16_round(_mm512_mul_ps(bf16_load(xr + i), inv));
        bf16_store(o + i, _mm512_mul_ps(bf16_load(w + i), normed));
      }
    }
  });
}
#endif

template <typename F>
void dispatch(const torch::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case torch::kFloat: f(float{}); break;
    case torch::kBFloat16: f(c10::BFloat16{}); break;
    case torch::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

}  // namespace

// RMSNorm of x [rows, dim] into a new tensor; with delta, first x += delta (in place)
// and normalise the sum (the residual stream).
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must match x's last dimension and dtype");
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto out = torch::empty_like(x);
#if defined(__AVX512F__)
  if (x.scalar_type() == torch::kBFloat16 && x.size(1) % 16 == 0) {
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
