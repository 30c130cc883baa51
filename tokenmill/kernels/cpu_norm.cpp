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

// ---- Qwen3.5 / Qwen3-Next: the zero-centered norm and the gated norm ----------------
namespace {

template <typename T>
inline float r(float v) { return static_cast<float>(static_cast<T>(v)); }

// Rows of a [R, D] or [T, H, D] tensor whose last dim is contiguous (a strided view of
// fused projections): row r of the 3-D form is (r / H, r % H).
template <typename T>
struct RowView {
  T* base;
  int64_t heads, s0, s1;
  explicit RowView(const torch::Tensor& t)
      : base(t.data_ptr<T>()), heads(t.dim() == 3 ? t.size(1) : 1), s0(t.stride(0)),
        s1(t.dim() == 3 ? t.stride(1) : 0) {}
  T* row(int64_t r) const { return base + (r / heads) * s0 + (r % heads) * s1; }
};

// f(float{}), f(c10::BFloat16{}) or f(c10::Half{}) as t is.
template <typename F>
void dispatch_floats(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": float32, bfloat16 or float16 only");
  }
}

void check_rows(const torch::Tensor& x, int64_t dim, const char* what) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.size(-1) == dim &&
                  (dim <= 1 || x.stride(-1) == 1),
              what, ": rows must be [R, ", dim, "] or [T, H, ", dim,
              "] with a contiguous last dim");
}

// sum of the squares of x[0, d) (fp32 values of T)
template <typename X>
inline float sum_squares(const X* x, int64_t d) {
  int64_t i = 0;
  Vec acc = Vec::zero();
  for (; i + W <= d; i += W) {
    const Vec v = Vec::load(x + i);
    acc = tmvec::fma(v, v, acc);
  }
  float ss = tmvec::reduce_add(acc);
  for (; i < d; ++i) ss += to_f(x[i]) * to_f(x[i]);
  return ss;
}

// y = round_T(x / rms(x) * (1 + w)), the product in fp32 (HF's Qwen3_5RMSNorm).
template <typename T>
void zero_centered_row(const T* x, const T* w, T* y, int64_t d, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  int64_t i = 0;
  const Vec vinv = Vec::set1(inv), one = Vec::set1(1.f);
  for (; i + W <= d; i += W)
    ((Vec::load(x + i) * vinv) * (one + Vec::load(w + i))).store(y + i);
  for (; i < d; ++i) y[i] = static_cast<T>((to_f(x[i]) * inv) * (1.f + to_f(w[i])));
}

// out = round_T(round_T(w * round_T(xr / rms(xr))) * silu(z)), xr = round_T(x), silu in
// fp32 (HF's Qwen3_5RMSNormGated on x already in T; x here may be its fp32 source).
template <typename T, typename X>
void gated_row(const X* x, const T* z, const T* w, T* y, float* tmp, int64_t d, float eps) {
  int64_t i = 0;
  for (; i + W <= d; i += W) tmvec::round_to<T>(Vec::load(x + i)).store(tmp + i);
  for (; i < d; ++i) tmp[i] = r<T>(to_f(x[i]));
  const float inv = 1.f / std::sqrt(sum_squares(tmp, d) / static_cast<float>(d) + eps);
  const Vec vinv = Vec::set1(inv), one = Vec::set1(1.f);
  Vec largest = Vec::set1(-INFINITY);  // the largest exp argument (as silu_mul_row)
  i = 0;
  for (; i + W <= d; i += W) {
    const Vec zv = Vec::load(z + i), arg = Vec::zero() - zv;
    largest = tmvec::max(largest, arg);
    const Vec normed = tmvec::round_to<T>(Vec::load(tmp + i) * vinv);
    const Vec scaled = tmvec::round_to<T>(Vec::load(w + i) * normed);
    (scaled * (zv / (one + tmvec::exp(arg)))).store(y + i);
  }
  if (!(tmvec::reduce_max(largest) <= 88.3f)) i = 0;  // exp would clamp: ATen's std::exp
  for (; i < d; ++i) {
    const float zf = to_f(z[i]);
    const float scaled = r<T>(to_f(w[i]) * r<T>(tmp[i] * inv));
    y[i] = static_cast<T>(scaled * (zf / (1.f + std::exp(-zf))));
  }
}

}  // namespace

// x [R, D] or [T, H, D] (last dim contiguous), weight [D] (x's dtype) -> contiguous,
// x's shape: x / rms(x) * (1 + weight) in fp32, rounded once (zero-centered weights).
torch::Tensor rms_norm_zero_centered(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm_zero_centered: weight must be contiguous [D] in x's dtype");
  const int64_t d = weight.size(0);
  check_rows(x, d, "rms_norm_zero_centered");
  torch::Tensor y = torch::empty(x.sizes(), x.options());
  const int64_t rows = d == 0 ? 0 : y.numel() / d;
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const RowView<scalar_t> xv(x);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        zero_centered_row<scalar_t>(xv.row(r), w, yp + r * d, d, static_cast<float>(eps));
    });
  };
  dispatch_floats(x.scalar_type(), "rms_norm_zero_centered", run);
  return y;
}

// residual [R, D] contiguous += x [R, D] (rows of any stride, last dim contiguous),
// rounded to the dtype in place; then -> rms_norm_zero_centered(residual). A layer's
// residual add folded into the next norm: one pass over the stream, the roundings of
// the add and the norm done one after the other.
torch::Tensor add_rms_norm_zero_centered_(torch::Tensor residual, torch::Tensor x,
                                          torch::Tensor weight, double eps) {
  const char* what = "add_rms_norm_zero_centered_";
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() &&
                  weight.scalar_type() == residual.scalar_type(),
              what, ": weight must be contiguous [D] in residual's dtype");
  const int64_t d = weight.size(0);
  TORCH_CHECK(residual.dim() == 2 && residual.size(1) == d && residual.is_contiguous(), what,
              ": residual must be contiguous [R, ", d, "]");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type() && (d <= 1 || x.stride(1) == 1),
              what, ": x must be shaped like residual, in its dtype, with contiguous rows");
  torch::Tensor y = torch::empty_like(residual);
  const int64_t rows = residual.size(0);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t ldx = x.stride(0);
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* rr = res + r * d;
        const scalar_t* xr = xp + r * ldx;
        int64_t i = 0;
        for (; i + W <= d; i += W) (Vec::load(rr + i) + Vec::load(xr + i)).store(rr + i);
        for (; i < d; ++i) rr[i] = static_cast<scalar_t>(to_f(rr[i]) + to_f(xr[i]));
        zero_centered_row<scalar_t>(rr, w, yp + r * d, d, static_cast<float>(eps));
      }
    });
  };
  dispatch_floats(residual.scalar_type(), what, run);
  return y;
}

// x [T, H, D] (fp32 or weight's dtype; last dim contiguous), z [T, H, D] (weight's
// dtype, last dim contiguous), weight [D] -> [T, H, D] in weight's dtype: each head's
// row normalised, times weight, times silu(z), rounded as Qwen3_5RMSNormGated on x
// rounded to the dtype.
torch::Tensor gated_rms_norm(torch::Tensor x, torch::Tensor z, torch::Tensor weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous(), "gated_rms_norm: weight must be [D]");
  const int64_t d = weight.size(0);
  check_rows(x, d, "gated_rms_norm");
  check_rows(z, d, "gated_rms_norm");
  TORCH_CHECK(x.dim() == z.dim() && x.sizes() == z.sizes(),
              "gated_rms_norm: x and z shapes differ");
  TORCH_CHECK(z.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == weight.scalar_type() || x.scalar_type() == at::kFloat),
              "gated_rms_norm: z in weight's dtype, x in it or float32");
  torch::Tensor y = torch::empty(x.sizes(), z.options());
  const int64_t rows = d == 0 ? 0 : y.numel() / d;
  const float e = static_cast<float>(eps);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const RowView<scalar_t> zv(z);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    auto rows_from = [&](auto xtag) {
      using X = decltype(xtag);
      const RowView<X> xv(x);
      at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
        std::vector<float> tmp(d);
        for (int64_t r = r0; r < r1; ++r)
          gated_row<scalar_t, X>(xv.row(r), zv.row(r), w, yp + r * d, tmp.data(), d, e);
      });
    };
    if (x.scalar_type() == at::kFloat) {
      rows_from(float{});
    } else {
      rows_from(scalar_t{});
    }
  };
  dispatch_floats(weight.scalar_type(), "gated_rms_norm", run);
  return y;
}
