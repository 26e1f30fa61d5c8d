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
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_kernel<T>(x.data_ptr<T>(), d.defined() ? d.data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                           out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}
