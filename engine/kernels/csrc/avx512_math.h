// AVX-512 helpers shared by the CPU attention kernels: 16-lane loads of float,
// bfloat16 and half rows as floats, exp for x <= 0, and an in-place softmax.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace splitserve_kernels {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for x <= 0: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and p the
// degree-7 Taylor polynomial (relative error < 1e-8 before float rounding).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of row[0:len] in place (len >= 1).
inline void softmax_row(float* row, int64_t len) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + t));
  float mx = _mm512_reduce_max_ps(vmax);
  for (; t < len; ++t) mx = row[t] > mx ? row[t] : mx;
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= len; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), vmx));
    _mm512_storeu_ps(row + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < len) {
    const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), vmx));
    _mm512_mask_storeu_ps(row + t, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  for (t = 0; t + 16 <= len; t += 16) _mm512_storeu_ps(row + t, _mm512_mul_ps(_mm512_loadu_ps(row + t), inv));
  for (; t < len; ++t) row[t] *= _mm512_cvtss_f32(inv);
}

}  // namespace splitserve_kernels
#endif
