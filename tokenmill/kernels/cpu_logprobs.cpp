// The logprobs a request asked for, from a step's log-probabilities [M, V]: each row's
// chosen token's rank and its k most likely tokens, in one pass over the row.
//
// torch did it in two: (logprobs > chosen).sum() for the rank, then topk(k), ~2 ms and
// ~1.7 ms at 128 rows of a 32k vocabulary on two threads (the forward of the bench
// model's whole step is ~20 ms). Here one vector pass per row counts the values above
// the chosen one and, W lanes at a time, compares them with the current k-th largest:
// only a block holding a larger value goes to the scalar insertion into the k kept
// (sorted, largest first; of equal values the earlier index first). Over a row in
// random order that is ~k ln(V / k) insertions.
//
// Same values as torch's: the rank counts strictly larger values (a NaN is larger than
// nothing; a NaN chosen value has rank 1), the top-k are the row's values themselves.
#include "ops.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "vec.h"

namespace {

using tmvec::Vec;
constexpr int W = Vec::W;
constexpr int64_t kMaxK = 64;

// Insert value v at index j into the k-long list (vals, ids) sorted largest first, the
// smallest dropped; a value equal to a kept one goes after it (the earlier index first).
inline void insert(float* vals, int64_t* ids, int64_t k, float v, int64_t j) {
  int64_t at = k - 1;
  if (!(v > vals[at])) return;
  while (at > 0 && v > vals[at - 1]) {
    vals[at] = vals[at - 1];
    ids[at] = ids[at - 1];
    --at;
  }
  vals[at] = v;
  ids[at] = j;
}

void row(const float* x, int64_t V, int64_t chosen, int64_t k, float* out_vals,
         int64_t* out_ids, int64_t* rank) {
  const float c = x[chosen];
  // The k kept start as -inf placeholders at index -1; a row of fewer than k finite
  // values keeps -inf entries at their own indices (filled after the pass).
  float vals[kMaxK];
  int64_t ids[kMaxK];
  for (int64_t i = 0; i < k; ++i) {
    vals[i] = -std::numeric_limits<float>::infinity();
    ids[i] = -1;
  }
  // Lane counts of values above the chosen one (exact in fp32 up to 2^24 a lane).
  const Vec cv = Vec::set1(c), one = Vec::set1(1.f);
  Vec count = Vec::zero();
  int64_t j = 0;
  alignas(64) float lane[W];
  for (; j + W <= V; j += W) {
    const Vec v = Vec::load(x + j);
    count = count + tmvec::keep_if_gt(one, v, cv);
    // (a NaN's lane never passes, whatever max() does with it: insert() refuses it)
    if (k > 0 && tmvec::reduce_max(v) > vals[k - 1]) {
      v.store(lane);
      for (int u = 0; u < W; ++u) insert(vals, ids, k, lane[u], j + u);
    }
  }
  int64_t above = static_cast<int64_t>(tmvec::reduce_add(count));
  for (; j < V; ++j) {
    above += x[j] > c;
    if (k > 0) insert(vals, ids, k, x[j], j);
  }
  // Places no value beat (-inf values, or V < k: a row of -inf): the first indices not
  // kept yet, in order, as torch.topk takes them.
  if (k > 0 && ids[k - 1] < 0) {
    int64_t next = 0;
    for (int64_t i = 0; i < k; ++i) {
      if (ids[i] >= 0) continue;
      bool taken = true;
      while (taken && next < V) {
        taken = false;
        for (int64_t u = 0; u < i; ++u) taken |= ids[u] == next;
        if (taken) ++next;
      }
      ids[i] = next < V ? next++ : 0;
      vals[i] = x[ids[i]];
    }
  }
  for (int64_t i = 0; i < k; ++i) {
    out_vals[i] = vals[i];
    out_ids[i] = ids[i];
  }
  *rank = above + 1;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> row_logprobs(torch::Tensor logprobs,
                                                                     torch::Tensor chosen,
                                                                     int64_t k) {
  TORCH_CHECK(logprobs.dim() == 2 && logprobs.size(1) > 0 && logprobs.stride(1) == 1 &&
                  logprobs.scalar_type() == at::kFloat,
              "row_logprobs: logprobs must be fp32 [M, V] (V >= 1) with contiguous rows");
  const int64_t M = logprobs.size(0), V = logprobs.size(1), ld = logprobs.stride(0);
  TORCH_CHECK(k >= 0 && k <= kMaxK && k <= V, "row_logprobs: k must be in [0, min(",
              kMaxK, ", V)], got ", k);
  TORCH_CHECK(chosen.dim() == 1 && chosen.size(0) == M, "row_logprobs: chosen must be [M]");
  const auto ch = chosen.to(at::kLong).contiguous();
  const int64_t* cp = ch.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(cp[r] >= 0 && cp[r] < V, "row_logprobs: chosen token ", cp[r],
                " of row ", r, " is outside the vocabulary of ", V);
  auto ids = torch::empty({M, 1 + k}, logprobs.options().dtype(at::kLong));
  auto vals = torch::empty({M, 1 + k}, logprobs.options());
  auto ranks = torch::empty({M}, logprobs.options().dtype(at::kLong));
  const float* x = logprobs.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* val = vals.data_ptr<float>();
  int64_t* rk = ranks.data_ptr<int64_t>();
  // (a row of a 32k vocabulary is ~10 us: one row a task is grain enough)
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * ld;
      id[r * (1 + k)] = cp[r];
      val[r * (1 + k)] = xr[cp[r]];
      row(xr, V, cp[r], k, val + r * (1 + k) + 1, id + r * (1 + k) + 1, rk + r);
    }
  });
  return {ids, vals, ranks};
}
