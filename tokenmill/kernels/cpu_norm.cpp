// RMSNorm in one pass per row: y = round(x / rms(x)) * w, computed in fp32.
//
// PyTorch's CPU rms_norm for bf16 is a chain of ops (cast, pow, mean, rsqrt,
// mul, cast, mul); at decode batch sizes their dispatch costs more than the
// math. The rounding follows HF's Llama/Qwen RMSNorm: the normalised value is
// rounded to the input dtype before the weight multiplies it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

template <typename T>
static inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
static void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T* yr = y + r * dim;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = to_f(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const T normed = static_cast<T>(to_f(xr[i]) * inv);  // rounded as HF rounds
        yr[i] = static_cast<T>(to_f(normed) * to_f(w[i]));
      }
    }
  });
}

// x [..., dim] contiguous, weight [dim] (same dtype) -> same shape and dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight is [dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  const int64_t dim = weight.size(0), rows = x.numel() / dim;
  torch::Tensor y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            y.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return y;
}
