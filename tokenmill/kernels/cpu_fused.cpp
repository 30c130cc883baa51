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

#include "cpu_vec.h"

namespace {

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

// Round to T and back: the value an op producing T would have stored.
template <typename T>
inline float r(float v) { return static_cast<float>(static_cast<T>(v)); }

// HF's Llama/Qwen RMSNorm over one head: fp32 statistics, the normalised value
// rounded to T, then times the weight in T.
template <typename T>
inline void head_norm(const T* x, const T* w, float* out, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += f(x[i]) * f(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = r<T>(r<T>(f(x[i]) * inv) * f(w[i]));
}

// Neox rotary on the first rd features: x * cos + rotate_half(x) * sin, each
// product and the sum rounded to T as three separate ops would round them.
template <typename T>
inline void rope(const float* x, const T* cos, const T* sin, T* out, int64_t d, int64_t rd) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < rd; ++i) {
    const float rot = i < half ? -x[i + half] : x[i - half];
    out[i] = static_cast<T>(r<T>(x[i] * f(cos[i])) + r<T>(rot * f(sin[i])));
  }
  for (int64_t i = rd; i < d; ++i) out[i] = static_cast<T>(x[i]);
}

template <typename T>
void silu_mul_row(const T* g, T* y, int64_t I) {
  const T* u = g + I;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {  // fp64 takes the scalar loop
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= I; i += 16) {
      const __m512 x = load16(g + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      store16(y + i, _mm512_mul_ps(round16<T>(_mm512_div_ps(x, _mm512_add_ps(one, e))),
                                   load16(u + i)));
    }
  }
#endif
  for (; i < I; ++i) {
    const float x = f(g[i]);
    y[i] = static_cast<T>(r<T>(x / (1.f + std::exp(-x))) * f(u[i]));
  }
}

#if defined(__AVX512F__)
// head_norm + rope for a head of d % 16 == 0 features whose rotary half is a
// multiple of 16: the same roundings, 16 lanes at a time.
template <typename T>
inline void norm_rope_vec(const T* x, const T* w, const T* cos, const T* sin, T* out, int64_t d,
                          int64_t rd, float eps) {
  float tmp[512];
  for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(tmp + i, load16(x + i));
  if (w != nullptr) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 v = _mm512_loadu_ps(tmp + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(
        1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 normed = round16<T>(_mm512_mul_ps(_mm512_loadu_ps(tmp + i), inv));
      _mm512_storeu_ps(tmp + i, round16<T>(_mm512_mul_ps(normed, load16(w + i))));
    }
  }
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 lo = _mm512_loadu_ps(tmp + i), hi = _mm512_loadu_ps(tmp + half + i);
    // out_lo = lo * cos - hi * sin, out_hi = hi * cos + lo * sin, each product rounded.
    store16(out + i, _mm512_sub_ps(round16<T>(_mm512_mul_ps(lo, load16(cos + i))),
                                   round16<T>(_mm512_mul_ps(hi, load16(sin + i)))));
    store16(out + half + i,
            _mm512_add_ps(round16<T>(_mm512_mul_ps(hi, load16(cos + half + i))),
                          round16<T>(_mm512_mul_ps(lo, load16(sin + half + i)))));
  }
  for (int64_t i = rd; i < d; i += 16) store16(out + i, _mm512_loadu_ps(tmp + i));
}
#endif

}  // namespace

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
  const bool vec = d % 16 == 0 && d <= 512 && (rd / 2) % 16 == 0 && (d - rd) % 16 == 0;
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
#if defined(__AVX512F__)
        if constexpr (!std::is_same_v<T_, double>) {
          if (vec) {
            norm_rope_vec<T_>(src, norm ? (is_q ? qw : kw) : nullptr, cp + t * rd, sp + t * rd,
                              dst, d, rd, static_cast<float>(eps));
            continue;
          }
        }
#endif
        if (norm) {
          head_norm<T_>(src, is_q ? qw : kw, tmp.data(), d, static_cast<float>(eps));
        } else {
          for (int64_t i = 0; i < d; ++i) tmp[i] = f(src[i]);
        }
        rope<T_>(tmp.data(), cp + t * rd, sp + t * rd, dst, d, rd);
      }
    });
  });
  return q;
}

// Writes k, v [T, hkv, d] (any row stride, contiguous heads) into the cache
// [num_blocks, 2, block_size, hkv, d] at (slot_block[t], slot_offset[t]).
void kv_cache_write(torch::Tensor cache, torch::Tensor k, torch::Tensor v,
                    torch::Tensor slot_block, torch::Tensor slot_offset) {
  TORCH_CHECK(cache.dim() == 5 && cache.stride(4) == 1 && cache.stride(3) == cache.size(4),
              "kv_cache_write: cache must be [num_blocks, 2, block_size, hkv, d]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == cache.size(3) &&
                  k.size(2) == cache.size(4) && v.sizes() == k.sizes(),
              "kv_cache_write: k / v must be [T, hkv, d] like the cache");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2),
              "kv_cache_write: k / v heads must be contiguous");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "kv_cache_write: k / v must be in the cache's dtype");
  TORCH_CHECK(slot_block.scalar_type() == at::kLong && slot_offset.scalar_type() == at::kLong &&
                  slot_block.numel() == k.size(0) && slot_offset.numel() == k.size(0),
              "kv_cache_write: slot_block / slot_offset must be [T] int64");
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
  const int64_t kst = k.stride(0) * es, vst = v.stride(0) * es;
  const int64_t s_block = cache.stride(0) * es, s_kv = cache.stride(1) * es,
                s_tok = cache.stride(2) * es;
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
