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

#include "vec.h"

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

using tmvec::Vec;
constexpr int W = Vec::W;

// One row; with `add` (may be null) the row first becomes round(x + add), which
// is written back to x (the residual stream) before it is normalised. W lanes at a
// time (fp64: the scalar loop), the same roundings in the scalar tail.
template <typename T>
inline void norm_row(T* x, const T* add, const T* w, T* y, int64_t dim, float eps) {
  constexpr bool vec = !std::is_same_v<T, double>;
  int64_t i = 0;
  float ss = 0.f;
  if constexpr (vec) {
    Vec acc = Vec::zero();
    for (; i + W <= dim; i += W) {
      Vec v = Vec::load(x + i);
      if (add != nullptr) {
        v = tmvec::round_to<T>(v + Vec::load(add + i));
        v.store(x + i);
      }
      acc = tmvec::fma(v, v, acc);
    }
    ss = tmvec::reduce_add(acc);
  }
  for (int64_t j = i; j < dim; ++j) {
    if (add != nullptr) x[j] = static_cast<T>(to_f(x[j]) + to_f(add[j]));
    ss += to_f(x[j]) * to_f(x[j]);
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  i = 0;
  if constexpr (vec) {
    const Vec vinv = Vec::set1(inv);
    for (; i + W <= dim; i += W) {
      const Vec normed = tmvec::round_to<T>(Vec::load(x + i) * vinv);  // rounded as HF rounds
      (normed * Vec::load(w + i)).store(y + i);
    }
  }
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
