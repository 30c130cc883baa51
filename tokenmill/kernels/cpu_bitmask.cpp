// A structured request's grammar bitmask on its logits row: forbidden tokens to -inf.
//
// The bitmask is xgrammar's: per row ceil(V / 32) int32 words, bit t % 32 of word t / 32
// set where token t is allowed. Unpacked into a [rows, V] bool tensor and applied by
// masked_fill it took ~10-15 ms a step at 128 rows of a 32k vocabulary on two threads
// (a step of the bench model's forward is ~20 ms). Here each word is read once: a word
// that allows everything is skipped, one that forbids everything writes 32 -infs, any
// other writes -inf at each of its clear bits.
#include "ops.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

namespace {

inline int lowest_bit(uint32_t w) {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_ctz(w);
#else
  int i = 0;
  while (!(w & 1u)) {
    w >>= 1;
    ++i;
  }
  return i;
#endif
}

}  // namespace

void grammar_bitmask_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "grammar_bitmask_: logits must be fp32 [N, V] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "grammar_bitmask_: rows must be a contiguous [R] int64 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.size(0) == rows.size(0) &&
                  bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "grammar_bitmask_: bitmask must be a contiguous [R, W] int32 tensor");
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  const int64_t R = rows.size(0), W = bitmask.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < N, "grammar_bitmask_: row ", row[i],
                " is outside the batch of ", N);
  // Tokens past the words (a bitmask narrower than the vocabulary) are left alone; bits
  // past the vocabulary are ignored.
  const int64_t words = std::min(W, (V + 31) / 32);
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* x = logits.data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // (a row of a 32k vocabulary is ~1000 words: one row a task is grain enough)
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* xr = x + row[i] * ld;
      const uint32_t* b = bits + i * W;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t forbid = ~b[w];
        const int64_t base = w * 32;
        if (base + 32 > V) forbid &= (1u << (V - base)) - 1u;  // (V - base < 32 here)
        if (forbid == 0u) continue;
        if (forbid == 0xFFFFFFFFu) {
          for (int u = 0; u < 32; ++u) xr[base + u] = kNegInf;
          continue;
        }
        while (forbid != 0u) {
          xr[base + lowest_bit(forbid)] = kNegInf;
          forbid &= forbid - 1u;
        }
      }
    }
  });
}
