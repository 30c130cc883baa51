// Greedy sampling's argmax over a step's logits [M, V], when every row is plain greedy
// and the int8-screened head did not take the step (more rows than its limit).
//
// torch's max(dim=1) returns values and indices through a reduction that keeps an
// index per element: at 128 rows of a 32k vocabulary in bf16 it took ~1.2 ms on two
// threads, ~4% of the bench model's decode step. Here each row is read once by the
// vector units for its maximum (per 256-value block: a max and a sum), and only the
// block holding the first maximum is read again, by scalar code, for its index.
//
// Semantics are torch.argmax's: the first of the largest values, and a row holding a
// NaN gives its first NaN's index (the flag out says which rows held one). A block's
// sum is NaN when the block holds a NaN (or +inf beside -inf): such a block is
// scanned by scalar code, so the vector max's NaN rules (which differ by ISA) never
// decide anything.
#include "ops.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "vec.h"

namespace {

using tmvec::Vec;
constexpr int64_t kBlock = 256;  // a multiple of every level's Vec::W
static_assert(kBlock % Vec::W == 0, "kBlock must hold whole vectors");

// The largest value of x[j0, j1) by scalar code; -> false with *nan_at set to the
// first NaN's index if there is one.
template <typename T>
inline bool scan(const T* x, int64_t j0, int64_t j1, float* max_out, int64_t* nan_at) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = j0; j < j1; ++j) {
    const float v = static_cast<float>(x[j]);
    if (std::isnan(v)) {
      *nan_at = j;
      return false;
    }
    m = v > m ? v : m;
  }
  *max_out = m;
  return true;
}

template <typename T>
void argmax_row(const T* x, int64_t n, int64_t* id, bool* nan) {
  float best = 0.f;
  int64_t best_start = -1, best_end = 0;  // the block holding the first maximum so far
  int64_t nan_at = -1;
  const int64_t full = n - n % kBlock;
  for (int64_t j = 0; j < n; j += kBlock) {
    const int64_t end = j + kBlock <= full ? j + kBlock : n;
    float bm;
    if (end - j == kBlock) {
      Vec m = Vec::load(x + j), s = m;
      for (int64_t k = Vec::W; k < kBlock; k += Vec::W) {
        const Vec v = Vec::load(x + j + k);
        m = tmvec::max(v, m);
        s = s + v;
      }
      bm = tmvec::reduce_max(m);
      if (std::isnan(tmvec::reduce_add(s)) && !scan(x, j, end, &bm, &nan_at)) break;
    } else if (!scan(x, j, end, &bm, &nan_at)) {
      break;
    }
    if (best_start < 0 || bm > best) {  // (strictly: an equal maximum later loses)
      best = bm;
      best_start = j;
      best_end = end;
    }
  }
  if (nan_at >= 0) {
    *id = nan_at;
    *nan = true;
    return;
  }
  int64_t at = best_start;
  while (at < best_end - 1 && static_cast<float>(x[at]) != best) ++at;
  *id = at;
  *nan = false;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> row_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "row_argmax: logits must be [M, V] (V >= 1) with contiguous rows");
  const int64_t M = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto ids = torch::empty({M}, logits.options().dtype(at::kLong));
  auto nan = torch::empty({M}, logits.options().dtype(at::kBool));
  int64_t* id = ids.data_ptr<int64_t>();
  bool* flag = nan.data_ptr<bool>();
  auto run = [&](const auto* x) {
    // (a row of a 32k vocabulary is ~10 us: one row a task is grain enough)
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) argmax_row(x + r * ld, V, id + r, flag + r);
    });
  };
  switch (logits.scalar_type()) {
    case at::kFloat: run(logits.data_ptr<float>()); break;
    case at::kBFloat16: run(logits.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(logits.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "row_argmax: logits must be fp32, bf16 or fp16");
  }
  return {ids, nan};
}
