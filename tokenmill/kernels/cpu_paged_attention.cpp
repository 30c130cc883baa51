// Paged decode attention for CPU: reads K/V straight from the cache blocks
// through the block table (no gather copy), fp32 accumulation, one job per
// (row, kv head) spread over the intra-op threads - or one per row when there
// are enough rows. With AVX-512 the head dimension is processed 16 lanes at a
// time (head_dim 64 has its own register-resident kernel); otherwise a plain loop.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

template <typename T>
struct Cache {
  const T* data;
  const int32_t* block_table;  // [rows, max_nb]
  int64_t max_nb, bs, s_block, s_kv, s_tok, s_head;
  // Calls fn(t, key_ptr, value_ptr) for tokens 0..len-1 of row r, head h,
  // walking block by block (no division per token).
  template <typename F>
  inline void for_each_token(int64_t r, int64_t h, int64_t len, F&& fn) const {
    const int32_t* row = block_table + r * max_nb;
    for (int64_t start = 0, b = 0; start < len; start += bs, ++b) {
      const T* k = data + row[b] * s_block + h * s_head;
      const int64_t n = std::min(bs, len - start);
      for (int64_t o = 0; o < n; ++o, k += s_tok) fn(start + o, k, k + s_kv);
    }
  }
};

// scores[j][t] = q_j . k_t for the g query heads sharing kv head h.
template <typename T>
static void qk(const float* qf, const Cache<T>& c, int64_t r, int64_t h, int64_t len, int64_t g,
               int64_t d, float* scores) {
#if defined(__AVX512F__)
  if (d == 64) {
    c.for_each_token(r, h, len, [&](int64_t t, const T* k, const T*) {
      const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
      for (int64_t j = 0; j < g; ++j) {
        const float* q = qf + j * d;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), k0);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), k1, acc);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), k2, acc);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), k3, acc);
        scores[j * len + t] = _mm512_reduce_add_ps(acc);
      }
    });
    return;
  }
  if (d % 16 == 0) {
    c.for_each_token(r, h, len, [&](int64_t t, const T* k, const T*) {
      for (int64_t j = 0; j < g; ++j) {
        const float* q = qf + j * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + x), load16(k + x), acc);
        scores[j * len + t] = _mm512_reduce_add_ps(acc);
      }
    });
    return;
  }
#endif
  c.for_each_token(r, h, len, [&](int64_t t, const T* k, const T*) {
    for (int64_t j = 0; j < g; ++j) {
      const float* q = qf + j * d;
      float s = 0.f;
      for (int64_t x = 0; x < d; ++x) s += q[x] * static_cast<float>(k[x]);
      scores[j * len + t] = s;
    }
  });
}

// acc[j] = sum_t p[j][t] v_t
template <typename T>
static void pv(const float* probs, const Cache<T>& c, int64_t r, int64_t h, int64_t len, int64_t g,
               int64_t d, float* acc) {
  std::fill(acc, acc + g * d, 0.f);
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    c.for_each_token(r, h, len, [&](int64_t t, const T*, const T* v) {
      for (int64_t x = 0; x < d; x += 16) {
        const __m512 vx = load16(v + x);
        for (int64_t j = 0; j < g; ++j) {
          float* a = acc + j * d + x;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(probs[j * len + t]), vx,
                                              _mm512_loadu_ps(a)));
        }
      }
    });
    return;
  }
#endif
  c.for_each_token(r, h, len, [&](int64_t t, const T*, const T* v) {
    for (int64_t j = 0; j < g; ++j) {
      const float p = probs[j * len + t];
      float* a = acc + j * d;
      for (int64_t x = 0; x < d; ++x) a[x] += p * static_cast<float>(v[x]);
    }
  });
}

static void softmax_rows(float* s, int64_t rows, int64_t len) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < rows; ++j, s += len) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    float m = _mm512_reduce_max_ps(vmax);
    for (; t < len; ++t) m = std::max(m, s[t]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= len; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
      _mm512_storeu_ps(s + t, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (t < len) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mv));
      _mm512_mask_storeu_ps(s + t, tail, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
    for (t = 0; t + 16 <= len; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    for (; t < len; ++t) s[t] *= _mm512_cvtss_f32(inv);
  }
  return;
#endif
  for (int64_t j = 0; j < rows; ++j, s += len) {
    float m = -INFINITY;
    for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
}

#if defined(__AVX512F__)
// Ask for the next cache block's K (or V) half while this one is computed:
// blocks are scattered, so the hardware prefetcher cannot guess the next one.
template <typename T>
static inline void prefetch_block(const T* p, int64_t elems) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(b + off, _MM_HINT_T0);
}

// head_dim 64, G query heads per kv head, kv heads [h0, h1) of row r; qf / out
// hold those heads' (h1 - h0) * G query / output rows. The query and output
// accumulators of a head live in registers (G x 4 vectors), so a token costs
// its K/V loads, the FMAs and one horizontal sum per query head. Blocks are
// walked once for all the heads: every head's K (then V) of a block is used
// while its lines are hot. A whole-row job (all heads) also prefetches the
// next block.
template <int G, typename T>
static void decode_heads_d64(const float* qf, const Cache<T>& c, int64_t r, int64_t h0,
                             int64_t h1, int64_t len, float* scores, float* out,
                             bool prefetch) {
  const int32_t* row = c.block_table + r * c.max_nb;
  const int64_t nh = h1 - h0;
  for (int64_t start = 0, b = 0; start < len; start += c.bs, ++b) {
    const T* kb = c.data + row[b] * c.s_block;
    const int64_t n = std::min(c.bs, len - start);
    if (prefetch && start + c.bs < len) prefetch_block(c.data + row[b + 1] * c.s_block, c.s_kv);
    for (int64_t i = 0; i < nh; ++i) {
      __m512 qv[G][4];
      for (int j = 0; j < G; ++j)
        for (int x = 0; x < 4; ++x) qv[j][x] = _mm512_loadu_ps(qf + (i * G + j) * 64 + x * 16);
      const T* k = kb + (h0 + i) * c.s_head;
      for (int64_t o = 0; o < n; ++o, k += c.s_tok) {
        const __m512 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
        for (int j = 0; j < G; ++j) {
          __m512 acc = _mm512_mul_ps(qv[j][0], k0);
          acc = _mm512_fmadd_ps(qv[j][1], k1, acc);
          acc = _mm512_fmadd_ps(qv[j][2], k2, acc);
          acc = _mm512_fmadd_ps(qv[j][3], k3, acc);
          scores[(i * G + j) * len + start + o] = _mm512_reduce_add_ps(acc);
        }
      }
    }
  }
  softmax_rows(scores, nh * G, len);
  std::fill(out, out + nh * G * 64, 0.f);
  for (int64_t start = 0, b = 0; start < len; start += c.bs, ++b) {
    const T* vb = c.data + row[b] * c.s_block + c.s_kv;
    const int64_t n = std::min(c.bs, len - start);
    if (prefetch && start + c.bs < len)
      prefetch_block(c.data + row[b + 1] * c.s_block + c.s_kv, c.s_kv);
    for (int64_t i = 0; i < nh; ++i) {
      __m512 acc[G][4];
      float* oh = out + i * G * 64;
      for (int j = 0; j < G; ++j)
        for (int x = 0; x < 4; ++x) acc[j][x] = _mm512_loadu_ps(oh + j * 64 + x * 16);
      const T* v = vb + (h0 + i) * c.s_head;
      for (int64_t o = 0; o < n; ++o, v += c.s_tok) {
        const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
        for (int j = 0; j < G; ++j) {
          const __m512 p = _mm512_set1_ps(scores[(i * G + j) * len + start + o]);
          acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
          acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
          acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
          acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
        }
      }
      for (int j = 0; j < G; ++j)
        for (int x = 0; x < 4; ++x) _mm512_storeu_ps(oh + j * 64 + x * 16, acc[j][x]);
    }
  }
}

template <int G, typename T>
static void decode_rows_d64(const T* q, const Cache<T>& c, const int32_t* seq_lens, T* out,
                            int64_t nd, int64_t hq, int64_t hkv, float scale) {
  at::parallel_for(0, nd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * 64), acc(hq * 64), scores;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = seq_lens[r];
      scores.resize(hq * len);
      for (int64_t i = 0; i < hq * 64; ++i) qf[i] = static_cast<float>(q[r * hq * 64 + i]) * scale;
      decode_heads_d64<G>(qf.data(), c, r, 0, hkv, len, scores.data(), acc.data(), true);
      for (int64_t i = 0; i < hq * 64; ++i) out[r * hq * 64 + i] = static_cast<T>(acc[i]);
    }
  });
}
#endif

template <typename T>
static void decode(const T* q, const Cache<T>& c, const int32_t* seq_lens, T* out, int64_t nd,
                   int64_t hq, int64_t hkv, int64_t d, float scale) {
  const int64_t g = hq / hkv;
#if defined(__AVX512F__)
  // Enough rows to keep every thread busy: one job per row (see decode_heads_d64).
  if (d == 64 && nd >= 4 * at::get_num_threads() && (g == 1 || g == 2 || g == 4)) {
    if (g == 1) decode_rows_d64<1>(q, c, seq_lens, out, nd, hq, hkv, scale);
    if (g == 2) decode_rows_d64<2>(q, c, seq_lens, out, nd, hq, hkv, scale);
    if (g == 4) decode_rows_d64<4>(q, c, seq_lens, out, nd, hq, hkv, scale);
    return;
  }
#endif
  at::parallel_for(0, nd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / hkv, h = job % hkv;
      const int64_t len = seq_lens[r];
      const int64_t q_off = (r * hq + h * g) * d;
      scores.resize(g * len);
      for (int64_t i = 0; i < g * d; ++i) qf[i] = static_cast<float>(q[q_off + i]) * scale;
#if defined(__AVX512F__)
      if (d == 64 && (g == 1 || g == 2 || g == 4)) {
        float* sp = scores.data();
        if (g == 1) decode_heads_d64<1>(qf.data(), c, r, h, h + 1, len, sp, acc.data(), false);
        if (g == 2) decode_heads_d64<2>(qf.data(), c, r, h, h + 1, len, sp, acc.data(), false);
        if (g == 4) decode_heads_d64<4>(qf.data(), c, r, h, h + 1, len, sp, acc.data(), false);
      } else
#endif
      {
        qk(qf.data(), c, r, h, len, g, d, scores.data());
        softmax_rows(scores.data(), g, len);
        pv(scores.data(), c, r, h, len, g, d, acc.data());
      }
      for (int64_t i = 0; i < g * d; ++i) out[q_off + i] = static_cast<T>(acc[i]);
    }
  });
}

// q [nd, Hq, D]; kv [num_blocks, 2, bs, Hkv, D] (dim 0 may be padded);
// block_table [nd, max_nb] int32; seq_lens [nd] int32 -> out [nd, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [nd, Hq, D] tensor");
  TORCH_CHECK(kv.dim() == 5 && kv.stride(4) == 1 && kv.stride(3) == kv.size(4),
              "kv cache must be [num_blocks, 2, block_size, Hkv, D] with contiguous heads");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "q and kv cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous());
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "query heads must be a multiple of kv heads");
  auto out = torch::empty_like(q);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Cache<T> c{reinterpret_cast<const T*>(kv.data_ptr()), block_table.data_ptr<int32_t>(),
               block_table.size(1), kv.size(2), kv.stride(0), kv.stride(1), kv.stride(2),
               kv.stride(3)};
    decode<T>(reinterpret_cast<const T*>(q.data_ptr()), c, seq_lens.data_ptr<int32_t>(),
              reinterpret_cast<T*>(out.data_ptr()), q.size(0), q.size(1), kv.size(3), q.size(2),
              static_cast<float>(scale));
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}
