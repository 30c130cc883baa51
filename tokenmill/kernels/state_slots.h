// The sequences of a recurrent-state kernel call (Gated DeltaNet's conv and delta rule):
// sequence i is tokens [cu_seqlens[i], cu_seqlens[i + 1]) of the call's T, reading its
// state from slot read_slots[i] and leaving it in write_slots[i] (the same slot: in
// place). The kernels run the sequences in parallel, so no sequence may read a slot
// another writes, nor two write one slot; checked here, with every slot in range.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace tmstate {

struct Sequences {
  const int64_t *cu, *rd, *wr;
  int64_t n;
};

inline Sequences check_sequences(const at::Tensor& cu_seqlens, const at::Tensor& read_slots,
                                 const at::Tensor& write_slots, int64_t T, int64_t slots,
                                 const char* what) {
  for (const auto* t : {&cu_seqlens, &read_slots, &write_slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), what,
                ": cu_seqlens and the slots must be contiguous int64 vectors");
  const int64_t n = read_slots.size(0);
  TORCH_CHECK(write_slots.size(0) == n && cu_seqlens.size(0) == n + 1, what,
              ": one read and one write slot per sequence, n + 1 cu_seqlens");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* rd = read_slots.data_ptr<int64_t>();
  const int64_t* wr = write_slots.data_ptr<int64_t>();
  TORCH_CHECK(n == 0 || (cu[0] == 0 && cu[n] == T), what, ": cu_seqlens must run 0 .. T");
  std::vector<int64_t> written(wr, wr + n);
  std::sort(written.begin(), written.end());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(cu[i] <= cu[i + 1], what, ": cu_seqlens must not decrease");
    TORCH_CHECK(rd[i] >= 0 && rd[i] < slots && wr[i] >= 0 && wr[i] < slots, what,
                ": slot out of range [0, ", slots, ")");
    TORCH_CHECK(i == 0 || written[i] != written[i - 1], what, ": two sequences write one slot");
    // (a slot another sequence writes would be read while it changes)
    TORCH_CHECK(rd[i] == wr[i] || !std::binary_search(written.begin(), written.end(), rd[i]),
                what, ": a sequence reads a slot another one writes");
  }
  return {cu, rd, wr, n};
}

}  // namespace tmstate
