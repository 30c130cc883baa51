// Latent-space decode attention for MLA (DeepSeek-V2 / V3's weight-absorbed form).
//
// Every query head of a row attends over the same cached latent rows
// [kv_lora_rank compressed kv | rope_dim k_pe], so the step is a small GEMM per row:
// scores [H, D] x [D, tile], then probabilities [H, tile] x [tile, kv_lora_rank].
// Each latent row is read once per decode row (not once per head, as the MQA route
// through paged_decode did): a tile of rows is walked for all heads while its lines
// are hot, with an online softmax (running max and sum per head) across tiles.
//
// Long rows are split across threads (split-K): the work is cut into spans of
// about equal token counts, each span keeps its own (max, sum, unnormalised
// output) per head, and the last span of a row to finish merges them; at::parallel_for
// hands out spans statically, so equal sizes are what balance the threads.
// fp32 math throughout (bf16 / fp16 caches widened on load), written against
// vec.h's Vec so every capability level (and aarch64) runs the same source.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "vec.h"

namespace {

using tmvec::Vec;
constexpr int W = Vec::W;
constexpr int kTile = 32;                            // tokens per online-softmax step
constexpr int kHeads = 4;                            // query heads per micro-tile
constexpr int kTT = Vec::kRegs >= 32 ? 4 : 2;        // tokens per score micro-tile
constexpr int kXT = Vec::kRegs >= 32 ? 4 : 2;        // output vectors per value micro-tile
constexpr int64_t kMinSpan = 128;                    // fewest tokens worth a span of their own

template <typename T>
struct Latents {
  const T* data;
  const int32_t* block_table;  // [rows, max_nb]
  int64_t max_nb, bs, s_block, s_tok;
  const T* row(int64_t r, int64_t t) const {
    return data + block_table[r * max_nb + t / bs] * s_block + (t % bs) * s_tok;
  }
};

// s[g * ld + t] = q_g . rows[t] over d values, for G heads (rows of q, d apart) and
// TT tokens: each loaded latent vector serves G heads, each query vector TT tokens.
template <int G, int TT, typename T>
inline void scores_tile(const float* q, int64_t d, const T* const* rows, float* s,
                        int64_t ld) {
  Vec acc[G][TT];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TT; ++t) acc[g][t] = Vec::zero();
  int64_t x = 0;
  for (; x + W <= d; x += W) {
    Vec cv[TT];
    for (int t = 0; t < TT; ++t) cv[t] = Vec::load(rows[t] + x);
    for (int g = 0; g < G; ++g) {
      const Vec qv = Vec::load(q + g * d + x);
      for (int t = 0; t < TT; ++t) acc[g][t] = tmvec::fma(qv, cv[t], acc[g][t]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TT; ++t) {
      float sum = tmvec::reduce_add(acc[g][t]);
      for (int64_t y = x; y < d; ++y) sum += q[g * d + y] * static_cast<float>(rows[t][y]);
      s[g * ld + t] = sum;
    }
}

template <int G, typename T>
inline void scores_heads(const float* q, int64_t d, const T* const* rows, int n, float* s,
                         int64_t ld) {
  int t = 0;
  for (; t + kTT <= n; t += kTT) scores_tile<G, kTT>(q, d, rows + t, s + t, ld);
  for (; t < n; ++t) scores_tile<G, 1>(q, d, rows + t, s + t, ld);
}

// out[g][x0 .. x0 + XT * W) += sum over the n tokens of p[g * ld + t] * rows[t][...]:
// the accumulators stay in registers across the tile's tokens.
template <int G, int XT, typename T>
inline void values_tile(const float* p, int64_t ld, const T* const* rows, int n, int64_t x0,
                        float* out, int64_t r) {
  Vec acc[G][XT];
  for (int g = 0; g < G; ++g)
    for (int x = 0; x < XT; ++x) acc[g][x] = Vec::load(out + g * r + x0 + x * W);
  for (int t = 0; t < n; ++t) {
    Vec pv[G];
    for (int g = 0; g < G; ++g) pv[g] = Vec::set1(p[g * ld + t]);
    const T* c = rows[t] + x0;
    for (int x = 0; x < XT; ++x) {
      const Vec cv = Vec::load(c + x * W);
      for (int g = 0; g < G; ++g) acc[g][x] = tmvec::fma(pv[g], cv, acc[g][x]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int x = 0; x < XT; ++x) acc[g][x].store(out + g * r + x0 + x * W);
}

template <int G, typename T>
inline void values_heads(const float* p, int64_t ld, const T* const* rows, int n, int64_t r,
                         float* out) {
  int64_t x0 = 0;
  for (; x0 + kXT * W <= r; x0 += kXT * W) values_tile<G, kXT>(p, ld, rows, n, x0, out, r);
  for (; x0 + W <= r; x0 += W) values_tile<G, 1>(p, ld, rows, n, x0, out, r);
  for (; x0 < r; ++x0)
    for (int g = 0; g < G; ++g) {
      float a = out[g * r + x0];
      for (int t = 0; t < n; ++t) a += p[g * ld + t] * static_cast<float>(rows[t][x0]);
      out[g * r + x0] = a;
    }
}

// s[0..n) <- exp(s - m); returns their sum.
inline float exp_sum(float* s, int n, float m) {
  const Vec mv = Vec::set1(m);
  Vec vsum = Vec::zero();
  int t = 0;
  for (; t + W <= n; t += W) {
    const Vec e = tmvec::exp(Vec::load(s + t) - mv);
    e.store(s + t);
    vsum = vsum + e;
  }
  float sum = tmvec::reduce_add(vsum);
  if (t < n) {  // lanes past n are -inf: their exp is 0
    float tail[W];
    std::fill(tail, tail + W, -INFINITY);
    std::copy(s + t, s + n, tail);
    const Vec e = tmvec::exp(Vec::load(tail) - mv);
    e.store_n(s + t, n - t);
    sum += tmvec::reduce_add(e);
  }
  return sum;
}

inline void scale_row(float* o, int64_t r, float a) {
  const Vec av = Vec::set1(a);
  int64_t x = 0;
  for (; x + W <= r; x += W) (Vec::load(o + x) * av).store(o + x);
  for (; x < r; ++x) o[x] *= a;
}

// Row r's tokens [t0, t1), all h heads (qf: [h, d], scaled): per head the running max
// m, the sum of exp(score - m) l, and o [h, r] = sum of exp(score - m) * c (not yet
// divided by l). s: scratch of h * kTile floats.
template <typename T>
void attend_span(const float* qf, const Latents<T>& c, int64_t row, int64_t t0, int64_t t1,
                 int64_t h, int64_t d, int64_t r, float* m, float* l, float* o, float* s) {
  std::fill(m, m + h, -INFINITY);
  std::fill(l, l + h, 0.f);
  std::fill(o, o + h * r, 0.f);
  const T* rows[kTile];
  for (int64_t a = t0; a < t1; a += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, t1 - a));
    for (int i = 0; i < n; ++i) rows[i] = c.row(row, a + i);
    int64_t j = 0;
    for (; j + kHeads <= h; j += kHeads)
      scores_heads<kHeads>(qf + j * d, d, rows, n, s + j * kTile, kTile);
    for (; j < h; ++j) scores_heads<1>(qf + j * d, d, rows, n, s + j * kTile, kTile);
    for (j = 0; j < h; ++j) {
      float* sj = s + j * kTile;
      const float mt = *std::max_element(sj, sj + n);
      const float mn = std::max(m[j], mt);
      const float sum = exp_sum(sj, n, mn);
      if (mn != m[j]) {  // a new maximum: rescale what the earlier tiles summed
        const float alpha = std::exp(m[j] - mn);  // 0 at the first tile (m = -inf)
        l[j] *= alpha;
        if (a != t0) scale_row(o + j * r, r, alpha);
        m[j] = mn;
      }
      l[j] += sum;
    }
    for (j = 0; j + kHeads <= h; j += kHeads)
      values_heads<kHeads>(s + j * kTile, kTile, rows, n, r, o + j * r);
    for (; j < h; ++j) values_heads<1>(s + j * kTile, kTile, rows, n, r, o + j * r);
  }
}

template <typename T>
inline void widen_scaled(const T* src, float* dst, int64_t n, float scale) {
  const Vec sv = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::load(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// dst[i] = src[i] * inv, narrowed to T (rounded as a c10 cast rounds).
template <typename T>
inline void narrow_scaled(const float* src, T* dst, int64_t n, float inv) {
  const Vec iv = Vec::set1(inv);
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::load(src + i) * iv).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * inv);
}

struct Span {
  int64_t row, t0, t1, slot;  // slot: its partials' index, -1 when it is the whole row
};

// Cut the rows into spans of about equal token counts: ~4 per thread when the rows
// are few or long (split-K), one per row when there are enough rows anyway.
// span_tokens > 0 forces the span length (tests).
std::vector<Span> plan(const int32_t* seq_lens, int64_t nd, int64_t span_tokens,
                       int64_t& slots) {
  int64_t total = 0;
  for (int64_t i = 0; i < nd; ++i) total += std::max<int32_t>(seq_lens[i], 0);
  int64_t chunk = span_tokens;
  if (chunk <= 0) {
    const int64_t threads = at::get_num_threads();
    chunk = threads > 1 ? std::max(kMinSpan, (total + 4 * threads - 1) / (4 * threads)) : total;
    chunk = std::max<int64_t>(kTile, (chunk + kTile - 1) / kTile * kTile);
  }
  std::vector<Span> spans;
  slots = 0;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t n = seq_lens[i];
    if (n <= 0) continue;  // a null row: its output stays zero
    const int64_t k = (n + chunk - 1) / chunk, piece = (n + k - 1) / k;
    for (int64_t a = 0; a < n; a += piece)
      spans.push_back({i, a, std::min(n, a + piece), k > 1 ? slots++ : -1});
  }
  return spans;
}

// Row `row`'s split spans [i0, i1) (consecutive in spans) merged into out: per head,
// sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s with M the spans' largest max.
template <typename T>
void merge_row(const std::vector<Span>& spans, int64_t i0, int64_t i1, const float* part,
               int64_t h, int64_t r, T* out, float* acc) {
  const int64_t row = spans[i0].row, stride = h * (r + 2);
  for (int64_t j = 0; j < h; ++j) {
    float mx = -INFINITY;
    for (int64_t i = i0; i < i1; ++i) mx = std::max(mx, part[spans[i].slot * stride + j]);
    std::fill(acc, acc + r, 0.f);
    float lsum = 0.f;
    for (int64_t i = i0; i < i1; ++i) {
      const float* base = part + spans[i].slot * stride;
      const float w = std::exp(base[j] - mx);
      lsum += w * base[h + j];
      const float* oj = base + 2 * h + j * r;
      const Vec wv = Vec::set1(w);
      int64_t x = 0;
      for (; x + W <= r; x += W) tmvec::fma(wv, Vec::load(oj + x), Vec::load(acc + x)).store(acc + x);
      for (; x < r; ++x) acc[x] += w * oj[x];
    }
    narrow_scaled(acc, out + (row * h + j) * r, r, 1.f / lsum);
  }
}

template <typename T>
void mla_decode_impl(const T* q, const Latents<T>& c, const int32_t* seq_lens, T* out,
                     int64_t nd, int64_t h, int64_t d, int64_t r, float scale,
                     int64_t span_tokens) {
  int64_t slots = 0;
  const std::vector<Span> spans = plan(seq_lens, nd, span_tokens, slots);
  const int64_t ns = static_cast<int64_t>(spans.size());
  // Partials of split rows: per slot, m [h], l [h], o [h, r]. The span that finishes
  // its row last merges it (one parallel region: no second barrier per call).
  std::vector<float> part(slots * h * (r + 2));
  std::vector<int64_t> first(nd, -1);  // a split row's first span
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[nd]);
  for (int64_t i = 0; i < nd; ++i) left[i].store(0, std::memory_order_relaxed);
  for (int64_t i = 0; i < ns; ++i)
    if (spans[i].slot >= 0) {
      if (first[spans[i].row] < 0) first[spans[i].row] = i;
      left[spans[i].row].fetch_add(1, std::memory_order_relaxed);
    }
  at::parallel_for(0, ns, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(h * d), s(h * kTile), ml(2 * h), o(h * r);
    int64_t widened = -1;
    for (int64_t i = begin; i < end; ++i) {
      const Span& sp = spans[i];
      if (sp.row != widened) {
        widen_scaled(q + sp.row * h * d, qf.data(), h * d, scale);
        widened = sp.row;
      }
      if (sp.slot < 0) {  // the whole row: normalise straight into out
        float *m = ml.data(), *l = ml.data() + h;
        attend_span(qf.data(), c, sp.row, sp.t0, sp.t1, h, d, r, m, l, o.data(), s.data());
        for (int64_t j = 0; j < h; ++j)
          narrow_scaled(o.data() + j * r, out + (sp.row * h + j) * r, r, 1.f / l[j]);
        continue;
      }
      float* base = part.data() + sp.slot * h * (r + 2);
      attend_span(qf.data(), c, sp.row, sp.t0, sp.t1, h, d, r, base, base + h, base + 2 * h,
                  s.data());
      // acq_rel: the merging span sees every other span's partials of the row.
      if (left[sp.row].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        int64_t i1 = first[sp.row];
        while (i1 < ns && spans[i1].row == sp.row) ++i1;
        merge_row(spans, first[sp.row], i1, part.data(), h, r, out, o.data());
      }
    }
  });
}

}  // namespace

// q [nd, H, kv_lora_rank + rope_dim] (q_nope absorbed through W_UK, then q_pe);
// cache [num_blocks, block_size, kv_lora_rank + rope_dim] (dim 0 may be padded);
// block_table [nd, max_nb] int32; seq_lens [nd] int32 (0: a null row, output 0)
// -> [nd, H, kv_lora_rank]: softmax(scale * q . latent) @ latent[:, :kv_lora_rank].
torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                         torch::Tensor seq_lens, double scale, int64_t kv_lora_rank,
                         int64_t span_tokens) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [nd, H, D] tensor");
  TORCH_CHECK(cache.dim() == 3 && cache.stride(2) == 1 && cache.size(2) == q.size(2),
              "cache must be [num_blocks, block_size, D] with contiguous rows, D as q's");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(kv_lora_rank > 0 && kv_lora_rank <= q.size(2), "kv_lora_rank out of range");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == q.size(0),
              "block_table must be a contiguous int32 [nd, max_nb] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0),
              "seq_lens must be a contiguous int32 [nd] tensor");
  auto out = torch::zeros({q.size(0), q.size(1), kv_lora_rank}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Latents<T> c{reinterpret_cast<const T*>(cache.data_ptr()), block_table.data_ptr<int32_t>(),
                 block_table.size(1), cache.size(1), cache.stride(0), cache.stride(1)};
    mla_decode_impl<T>(reinterpret_cast<const T*>(q.data_ptr()), c,
                       seq_lens.data_ptr<int32_t>(), reinterpret_cast<T*>(out.data_ptr()),
                       q.size(0), q.size(1), q.size(2), kv_lora_rank, static_cast<float>(scale),
                       span_tokens);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "mla_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}
