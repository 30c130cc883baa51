// Fused elementwise steps of a decoder layer, one op each instead of a chain.
//
// At decode batch sizes every ATen op costs a few microseconds of dispatch
// whatever its size; a Qwen3 attention block spent ~25 of them on splitting
// q/k/v, two per-head RMSNorms, rotary (chunk, neg, cat, mul, mul, add) and
// two index_put cache writes. Each kernel below rounds where the PyTorch
// chain (and HF's modeling code) rounds, so bf16 results match bit for bit
// up to the summation order of the norm's mean; fp32 is computed in fp32.
#include "ops.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "vec_fp8.h"

namespace {

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

// Round to T and back: the value an op producing T would have stored.
template <typename T>
inline float r(float v) { return static_cast<float>(static_cast<T>(v)); }

using tmvec::Vec;
constexpr int W = Vec::W;

// fp64 has no Vec: it runs the scalar loops (the tails) only.
template <typename T>
constexpr bool kVec = !std::is_same_v<T, double>;

// One head: HF's Llama/Qwen RMSNorm when w is given (fp32 statistics, the
// normalised value rounded to T, then times the weight in T), then neox rotary on
// the first rd features: x * cos + rotate_half(x) * sin, each product and the sum
// rounded to T as three separate ops would round them; features rd.. pass through.
// W lanes at a time, each scalar tail with the same roundings. tmp: d floats.
template <typename T>
inline void norm_rope(const T* x, const T* w, const T* cos, const T* sin, T* out, int64_t d,
                      int64_t rd, float eps, float* tmp) {
  int64_t i = 0;
  if constexpr (kVec<T>)
    for (; i + W <= d; i += W) Vec::load(x + i).store(tmp + i);
  for (; i < d; ++i) tmp[i] = f(x[i]);
  if (w != nullptr) {
    float ss = 0.f;
    i = 0;
    if constexpr (kVec<T>) {
      Vec vss = Vec::zero();
      for (; i + W <= d; i += W) {
        const Vec v = Vec::load(tmp + i);
        vss = tmvec::fma(v, v, vss);
      }
      ss = tmvec::reduce_add(vss);
    }
    for (; i < d; ++i) ss += tmp[i] * tmp[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    i = 0;
    if constexpr (kVec<T>) {
      const Vec vinv = Vec::set1(inv);
      for (; i + W <= d; i += W) {
        const Vec normed = tmvec::round_to<T>(Vec::load(tmp + i) * vinv);
        tmvec::round_to<T>(normed * Vec::load(w + i)).store(tmp + i);
      }
    }
    for (; i < d; ++i) tmp[i] = r<T>(r<T>(tmp[i] * inv) * f(w[i]));
  }
  // out_lo = lo * cos - hi * sin, out_hi = hi * cos + lo * sin: rotate_half negates
  // hi, and round(-a) = -round(a), so this is the chain's x * cos + rot * sin.
  const int64_t half = rd / 2;
  i = 0;
  if constexpr (kVec<T>) {
    for (; i + W <= half; i += W) {
      const Vec lo = Vec::load(tmp + i), hi = Vec::load(tmp + half + i);
      (tmvec::round_to<T>(lo * Vec::load(cos + i)) - tmvec::round_to<T>(hi * Vec::load(sin + i)))
          .store(out + i);
      (tmvec::round_to<T>(hi * Vec::load(cos + half + i)) +
       tmvec::round_to<T>(lo * Vec::load(sin + half + i)))
          .store(out + half + i);
    }
  }
  for (; i < half; ++i) {
    const float lo = tmp[i], hi = tmp[half + i];
    out[i] = static_cast<T>(r<T>(lo * f(cos[i])) - r<T>(hi * f(sin[i])));
    out[half + i] = static_cast<T>(r<T>(hi * f(cos[half + i])) + r<T>(lo * f(sin[half + i])));
  }
  i = rd;
  if constexpr (kVec<T>)
    for (; i + W <= d; i += W) Vec::load(tmp + i).store(out + i);
  for (; i < d; ++i) out[i] = static_cast<T>(tmp[i]);
}

// silu(gate) * up for one row, rounded as F.silu(gate) * up: silu in fp32 as
// ATen computes it, x / (1 + exp(-x)), rounded to T, then times up.
template <typename T>
void silu_mul_row(const T* g, T* y, int64_t I) {
  const T* u = g + I;
  int64_t i = 0;
  if constexpr (kVec<T>) {
    const Vec one = Vec::set1(1.f);
    Vec largest = Vec::set1(-INFINITY);  // the largest exp argument of the row
    for (; i + W <= I; i += W) {
      const Vec x = Vec::load(g + i);
      const Vec arg = Vec::zero() - x;
      largest = tmvec::max(arg, largest);
      (tmvec::round_to<T>(x / (one + tmvec::exp(arg))) * Vec::load(u + i)).store(y + i);
    }
    // vec.h's exp clamps its argument at 88.3 (fp32 exp overflows from 88.73 on, and
    // silu is then -0): a row with a gate that negative (or a NaN) is redone with
    // std::exp, so the result stays ATen's there too.
    if (!(tmvec::reduce_max(largest) <= 88.3f)) i = 0;
  }
  for (; i < I; ++i) {
    const float x = f(g[i]);
    y[i] = static_cast<T>(r<T>(x / (1.f + std::exp(-x))) * f(u[i]));
  }
}

// gelu_tanh(gate) * up for one row (Gemma's MLP). gelu_tanh(x) = 0.5 x (1 + tanh(z))
// with z = sqrt(2/pi) (x + 0.044715 x^3), which is x * sigmoid(2 z): the same shape
// as silu, so the same vector exp and the same overflow fallback serve it. The gelu
// is rounded to T before the product, as F.gelu(gate) * up rounds.
// n elements of a row from g, whose up half starts up_off after it.
template <typename T>
void gelu_tanh_mul_chunk(const T* g, int64_t up_off, T* y, int64_t I) {
  constexpr float kC = 2.f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  constexpr float kA = 0.044715f;
  const T* u = g + up_off;
  int64_t i = 0;
  if constexpr (kVec<T>) {
    const Vec one = Vec::set1(1.f), c = Vec::set1(kC), a = Vec::set1(kA);
    Vec largest = Vec::set1(-INFINITY);
    for (; i + W <= I; i += W) {
      const Vec x = Vec::load(g + i);
      const Vec arg = Vec::zero() - c * (x + a * x * x * x);
      largest = tmvec::max(arg, largest);
      (tmvec::round_to<T>(x / (one + tmvec::exp(arg))) * Vec::load(u + i)).store(y + i);
    }
    if (!(tmvec::reduce_max(largest) <= 88.3f)) i = 0;  // (as silu_mul_row)
  }
  for (; i < I; ++i) {
    const float x = f(g[i]);
    y[i] = static_cast<T>(r<T>(x / (1.f + std::exp(-kC * (x + kA * x * x * x)))) * f(u[i]));
  }
}

}  // namespace

// gate_up [T, 2 I] -> gelu_tanh(gate) * up [T, I] (Gemma's MLP).
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gelu_tanh_mul: gate_up must be [T, 2 I] with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(),
                                  "gelu_tanh_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // Decode rows are few and long: split each row into chunks of whole vectors.
    constexpr int64_t kChunk = 1024;
    const int64_t per_row = (I + kChunk - 1) / kChunk;
    tmpar::parallel_for(0, T * per_row, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t t = j / per_row, c0 = j % per_row * kChunk;
        const int64_t n = std::min(kChunk, I - c0);
        gelu_tanh_mul_chunk(in + t * ld + c0, I, o + t * I + c0, n);
      }
    });
  });
  return out;
}

// qkv [T, (hq + 2 hkv) d] (rows may be strided); q_weight / k_weight [d] or
// empty (no q/k norm); cos / sin [T, rd] in qkv's dtype. Returns q [T, hq, d]
// contiguous and rotates the k part of qkv in place (v is untouched).
torch::Tensor qk_norm_rope(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight,
                           torch::Tensor cos, torch::Tensor sin, int64_t hq, int64_t hkv,
                           int64_t d, int64_t rd, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (hq + 2 * hkv) * d,
              "qk_norm_rope: qkv must be [T, (hq + 2 hkv) d] with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == rd &&
                  cos.numel() == qkv.size(0) * rd && rd % 2 == 0 && rd <= d,
              "qk_norm_rope: cos / sin must be [T, rotary_dim]");
  const bool norm = q_weight.defined() && q_weight.numel() > 0;
  TORCH_CHECK(!norm || (q_weight.numel() == d && k_weight.numel() == d &&
                        q_weight.scalar_type() == qkv.scalar_type() &&
                        k_weight.scalar_type() == qkv.scalar_type()),
              "qk_norm_rope: q/k norm weights must be [head_dim] in qkv's dtype");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "qk_norm_rope: cos / sin must be in qkv's dtype");
  const int64_t T = qkv.size(0), ld = qkv.stride(0);
  auto q = torch::empty({T, hq, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qk_norm_rope", [&] {
    using T_ = scalar_t;
    T_* base = qkv.data_ptr<T_>();
    T_* qo = q.data_ptr<T_>();
    const T_* qw = norm ? q_weight.data_ptr<T_>() : nullptr;
    const T_* kw = norm ? k_weight.data_ptr<T_>() : nullptr;
    const T_* cp = cos.data_ptr<T_>();
    const T_* sp = sin.data_ptr<T_>();
    // A large grain: waking the second thread costs more than a decode step's heads.
    at::parallel_for(0, T * (hq + hkv), 1024, [&](int64_t j0, int64_t j1) {
      std::vector<float> tmp(d);
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t t = j / (hq + hkv), h = j % (hq + hkv);
        const bool is_q = h < hq;
        T_* src = base + t * ld + h * d;  // k heads follow the q heads in a row
        T_* dst = is_q ? qo + (t * hq + h) * d : src;
        const T_* w = norm ? (is_q ? qw : kw) : nullptr;
        norm_rope<T_>(src, w, cp + t * rd, sp + t * rd, dst, d, rd, static_cast<float>(eps),
                      tmp.data());
      }
    });
  });
  return q;
}

// Writes k, v [T, hkv, d] (any row stride, contiguous heads) into the cache
// [num_blocks, 2, block_size, hkv, d] at (slot_block[t], slot_offset[t]). A
// float8_e4m3fn cache (--kv-cache-dtype fp8) takes k / v of any float dtype, each
// element rounded to nearest even and saturated at +-448 (tmvec::e4m3_saturate: the
// code torch's clamp + cast gives); otherwise k / v are in the cache's dtype and are
// copied as bytes.
void kv_cache_write(torch::Tensor cache, torch::Tensor k, torch::Tensor v,
                    torch::Tensor slot_block, torch::Tensor slot_offset, double k_scale,
                    double v_scale) {
  TORCH_CHECK(cache.dim() == 5 && cache.stride(4) == 1 && cache.stride(3) == cache.size(4),
              "kv_cache_write: cache must be [num_blocks, 2, block_size, hkv, d]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == cache.size(3) &&
                  k.size(2) == cache.size(4) && v.sizes() == k.sizes(),
              "kv_cache_write: k / v must be [T, hkv, d] like the cache");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "kv_cache_write: k / v heads must be contiguous");
  const bool fp8 = cache.scalar_type() == at::kFloat8_e4m3fn;
  const auto kt = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == kt &&
                  (fp8 ? (kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf)
                       : kt == cache.scalar_type()),
              "kv_cache_write: k / v must be in the cache's dtype (fp32 / bf16 / fp16 for a "
              "float8_e4m3fn cache)");
  TORCH_CHECK(slot_block.scalar_type() == at::kLong && slot_offset.scalar_type() == at::kLong &&
                  slot_block.numel() == k.size(0) && slot_offset.numel() == k.size(0),
              "kv_cache_write: slot_block / slot_offset must be [T] int64");
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "kv_cache_write: k_scale / v_scale must be finite and positive");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "kv_cache_write: k_scale / v_scale apply to a float8_e4m3fn cache only");
  auto sb = slot_block.contiguous(), so = slot_offset.contiguous();
  const int64_t T = k.size(0), row = k.size(1) * k.size(2) * k.element_size();
  const int64_t nblocks = cache.size(0), bs = cache.size(2);
  const int64_t* b = sb.data_ptr<int64_t>();
  const int64_t* o = so.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(b[t] >= 0 && b[t] < nblocks && o[t] >= 0 && o[t] < bs,
                "kv_cache_write: slot out of range");
  auto* c = static_cast<char*>(cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = cache.element_size();
  const int64_t s_block = cache.stride(0) * es, s_kv = cache.stride(1) * es,
                s_tok = cache.stride(2) * es;
  if (fp8) {
    const int64_t n = k.size(1) * k.size(2), kst = k.stride(0), vst = v.stride(0);
    const float k_div = static_cast<float>(k_scale), v_div = static_cast<float>(v_scale);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kt, "kv_cache_write", [&] {
      const auto* ks = reinterpret_cast<const scalar_t*>(kp);
      const auto* vs = reinterpret_cast<const scalar_t*>(vp);
      at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          char* dst = c + b[t] * s_block + o[t] * s_tok;
          auto* dk = reinterpret_cast<c10::Float8_e4m3fn*>(dst);
          auto* dv = reinterpret_cast<c10::Float8_e4m3fn*>(dst + s_kv);
          const scalar_t* kr = ks + t * kst;
          const scalar_t* vr = vs + t * vst;
          // x / scale in fp32 (exact for scale 1), as the PyTorch reference divides.
          for (int64_t i = 0; i < n; ++i) {
            dk[i] = tmvec::e4m3_saturate(static_cast<float>(kr[i]) / k_div);
            dv[i] = tmvec::e4m3_saturate(static_cast<float>(vr[i]) / v_div);
          }
        }
      });
    });
    return;
  }
  const int64_t kst = k.stride(0) * es, vst = v.stride(0) * es;
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      char* dst = c + b[t] * s_block + o[t] * s_tok;
      std::memcpy(dst, kp + t * kst, row);
      std::memcpy(dst + s_kv, vp + t * vst, row);
    }
  });
}

// gate_up [T, 2 I] -> silu(gate) * up [T, I], rounded as F.silu(gate) * up.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [T, 2 I] with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) silu_mul_row(in + t * ld, o + t * I, I);
    });
  });
  return out;
}
