// RMSNorm in one pass per row: y = round(x / rms(x)) * w, computed in fp32,
// and the residual form that first adds the sublayer output into the stream.
//
// PyTorch's CPU rms_norm for bf16 is a chain of ops (cast, pow, mean, rsqrt,
// mul, cast, mul); at decode batch sizes their dispatch costs more than the
// math. The rounding follows HF's Llama/Qwen RMSNorm: the normalised value is
// rounded to the input dtype before the weight multiplies it.
#include "ops.h"
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_vec.h"

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// One row; with `add` (may be null) the row first becomes round(x + add), which
// is written back to x (the residual stream) before it is normalised.
template <typename T>
inline void norm_row(T* x, const T* add, const T* w, T* y, int64_t dim, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
      __m512 v = load16(x + i);
      if (add != nullptr) {
        v = round16<T>(_mm512_add_ps(v, load16(add + i)));
        store16(x + i, v);
      }
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
  }
#endif
  for (int64_t j = i; j < dim; ++j) {
    if (add != nullptr) x[j] = static_cast<T>(to_f(x[j]) + to_f(add[j]));
    ss += to_f(x[j]) * to_f(x[j]);
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= dim; i += 16) {
      const __m512 normed = round16<T>(_mm512_mul_ps(load16(x + i), vinv));
      store16(y + i, _mm512_mul_ps(normed, load16(w + i)));
    }
  }
#endif
  for (; i < dim; ++i) {
    const T normed = static_cast<T>(to_f(x[i]) * inv);  // rounded as HF rounds
    y[i] = static_cast<T>(to_f(normed) * to_f(w[i]));
  }
}

template <typename T>
void norm_rows(T* x, const T* add, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  // A large grain: waking the second thread costs more than a few rows.
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row<T>(x + r * dim, add != nullptr ? add + r * dim : nullptr, w, y + r * dim, dim, eps);
  });
}

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight is [dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
}

}  // namespace

// x [..., dim] contiguous, weight [dim] (same dtype) -> same shape and dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, weight);
  const int64_t dim = weight.size(0), rows = x.numel() / dim;
  torch::Tensor y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                        y.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return y;
}

// residual += x (rounded to the dtype, in place), then -> rms_norm(residual).
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                            double eps) {
  check(residual, weight);
  TORCH_CHECK(x.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: x must be contiguous and shaped like residual");
  const int64_t dim = weight.size(0), rows = residual.numel() / dim;
  torch::Tensor y = torch::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                        weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, dim,
                        static_cast<float>(eps));
  });
  return y;
}
