// Paged decode attention for CPU: reads K/V straight from the cache blocks
// through the block table (no gather copy), fp32 accumulation, one job per
// (row, kv head) spread over the intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// Decode attention over a paged KV cache: one query token per row.
// q [nd, Hq, D]; kv [num_blocks, 2, bs, Hkv, D] (any strides on dim 0);
// block_table [nd, max_nb] int32; seq_lens [nd] int32; out [nd, Hq, D].
template <typename T>
static void decode_kernel(const T* q, const T* kv, const int32_t* bt, const int32_t* seq_lens,
                          T* out, int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                          int64_t max_nb, int64_t s_block, int64_t s_kv, int64_t s_tok,
                          int64_t s_head, float scale) {
  const int64_t g = hq / hkv;
  at::parallel_for(0, nd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / hkv, h = job % hkv;
      const int64_t len = seq_lens[r];
      scores.resize(g * len);
      for (int64_t i = 0; i < g * d; ++i)
        qf[i] = static_cast<float>(q[(r * hq + h * g) * d + i]) * scale;
      // Pass 1: scores[j][t] = q_j . k_t
      for (int64_t t = 0; t < len; ++t) {
        const int64_t blk = bt[r * max_nb + t / bs];
        const T* k = kv + blk * s_block + (t % bs) * s_tok + h * s_head;
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * d;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t c = 0; c < d; ++c) s += qj[c] * static_cast<float>(k[c]);
          scores[j * len + t] = s;
        }
      }
      // Softmax per query head.
      for (int64_t j = 0; j < g; ++j) {
        float* sj = scores.data() + j * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sj[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sj[t] = std::exp(sj[t] - m); sum += sj[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
      }
      // Pass 2: acc[j] = sum_t p[j][t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t blk = bt[r * max_nb + t / bs];
        const T* v = kv + blk * s_block + s_kv + (t % bs) * s_tok + h * s_head;
        for (int64_t j = 0; j < g; ++j) {
          const float p = scores[j * len + t];
          float* aj = acc.data() + j * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) aj[c] += p * static_cast<float>(v[c]);
        }
      }
      for (int64_t i = 0; i < g * d; ++i) out[(r * hq + h * g) * d + i] = static_cast<T>(acc[i]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4));
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(),
                            block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                            out.data_ptr<scalar_t>(), q.size(0), q.size(1), kv.size(3), q.size(2),
                            kv.size(2), block_table.size(1), kv.stride(0), kv.stride(1),
                            kv.stride(2), kv.stride(3), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache");
}
