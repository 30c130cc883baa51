// The depthwise causal conv1d + SiLU in front of Gated DeltaNet's delta rule (Qwen3.5 /
// Qwen3-Next), for every sequence of a call (a prompt chunk, a batch of decode rows),
// each continuing from the last K - 1 inputs its conv state slot holds.
//
// Token-major and vectorised over channels: out[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]),
// the inputs before the chunk read from the state, the chunk's last K - 1 inputs left
// in the state. The state keeps them token-major ([K - 1, C] a slot, as x's rows), so a
// window reaching into it (every decode row's) is vector loads too. Rounded as the
// PyTorch path rounds it (F.conv1d in the model dtype, then F.silu): the sum in fp32
// rounded to the dtype, silu of that in fp32 rounded again. That path transposed the
// chunk to channel-major, concatenated the state in front, convolved and transposed
// back: ~8 ms a layer for 2,000 tokens of 1,024 channels in bf16 on 2 cores, where this
// reads each input K times from L1.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "state_slots.h"
#include "vec.h"

namespace {

using tmvec::Vec;
constexpr int W = Vec::W;
constexpr int64_t kChannels = 64;  // channels per job
constexpr int kMaxK = 8;           // kernel sizes the kernel takes (Qwen's is 4)

template <typename T>
inline float r(float v) { return static_cast<float>(static_cast<T>(v)); }

// silu(y) rounded to T for y already rounded to T: y / (1 + exp(-y)) in fp32, as ATen.
template <typename T>
inline float silu_scalar(float y) { return r<T>(y / (1.f + std::exp(-y))); }

// Channels [c0, c0 + n) of one sequence: tokens [t0, t1) of x, its history from the
// state rows at `hist` (K - 1 rows of C inputs, oldest first), the last K - 1 inputs
// into the rows at `next` (the same rows: in place); wt the block's weights,
// channel-innermost fp32 (wt[j][c]).
template <typename T>
void conv_channels(const T* x, int64_t ldx, const float (&wt)[kMaxK][kChannels], int64_t K,
                   const T* hist, T* next, int64_t C, int64_t t0, int64_t t1, int64_t c0,
                   int64_t n, T* out, int64_t ldo) {
  const int64_t km1 = K - 1, L = t1 - t0;
  // Input i of the sequence's window (i < 0: the history), from channel c0 on.
  auto row = [&](int64_t i) -> const T* {
    return i < 0 ? hist + (km1 + i) * C + c0 : x + (t0 + i) * ldx + c0;
  };
  out += t0 * ldo + c0;
  for (int64_t t = 0; t < L; ++t) {
    const T* rows[kMaxK];
    for (int64_t j = 0; j < K; ++j) rows[j] = row(t - km1 + j);
    int64_t c = 0;
    Vec largest = Vec::set1(-INFINITY);  // the largest exp argument of the token
    for (; c + W <= n; c += W) {
      Vec acc = Vec::zero();
      for (int64_t j = 0; j < K; ++j)
        acc = tmvec::fma(Vec::load(wt[j] + c), Vec::load(rows[j] + c), acc);
      const Vec y = tmvec::round_to<T>(acc);
      const Vec arg = Vec::zero() - y;
      largest = tmvec::max(largest, arg);
      tmvec::round_to<T>(y / (Vec::set1(1.f) + tmvec::exp(arg))).store(out + t * ldo + c);
    }
    // exp clamps its argument at 88.3 (or a NaN came): the token's channels again with
    // std::exp, as ATen computes them
    if (!(tmvec::reduce_max(largest) <= 88.3f)) c = 0;
    for (; c < n; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < K; ++j)
        acc = std::fma(wt[j][c], static_cast<float>(rows[j][c]), acc);
      out[t * ldo + c] = static_cast<T>(silu_scalar<T>(r<T>(acc)));
    }
  }
  // The state after the chunk: its last K - 1 inputs (the history's tail if shorter).
  // Row j takes input L - K + 1 + j: from x, or (a chunk shorter than K - 1) from the
  // history row L + j, which in place is not yet overwritten (rows go in order, L >= 1).
  if (L == 0) {
    if (next != hist)
      for (int64_t j = 0; j < km1; ++j) std::copy_n(hist + j * C + c0, n, next + j * C + c0);
    return;
  }
  for (int64_t j = 0; j < km1; ++j) std::copy_n(row(L - km1 + j), n, next + j * C + c0);
}

}  // namespace

// x [T, C] (rows of any stride, channels contiguous), conv_state [S, K - 1, C] (a slot's
// last K - 1 inputs, oldest first, as x's rows) and weight [C, K] contiguous, all one
// dtype. Sequence n is tokens [cu_seqlens[n], cu_seqlens[n + 1]), from
// conv_state[read_slots[n]] into conv_state[write_slots[n]];
// no sequence may read a slot another writes. Returns silu(conv) [T, C] in x's dtype.
torch::Tensor causal_conv1d_silu(torch::Tensor x, torch::Tensor conv_state, torch::Tensor weight,
                                 torch::Tensor cu_seqlens, torch::Tensor read_slots,
                                 torch::Tensor write_slots) {
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "causal_conv1d_silu: x must be [T, C] with contiguous rows");
  const int64_t T = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.is_contiguous() &&
                  weight.size(1) >= 1 && weight.size(1) <= kMaxK,
              "causal_conv1d_silu: weight must be contiguous [C, K] with 1 <= K <= ", kMaxK);
  const int64_t K = weight.size(1);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == K - 1 && conv_state.size(2) == C &&
                  conv_state.is_contiguous(),
              "causal_conv1d_silu: conv_state must be contiguous [S, ", K - 1, ", ", C, "], got ",
              conv_state.sizes());
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "causal_conv1d_silu: x, conv_state and weight must share a dtype");
  const tmstate::Sequences sq =
      tmstate::check_sequences(cu_seqlens, read_slots, write_slots, T, conv_state.size(0),
                               "causal_conv1d_silu");
  const int64_t n = sq.n;
  const int64_t *cu = sq.cu, *rd = sq.rd, *wr = sq.wr;
  auto out = torch::empty({T, C}, x.options());
  if (n == 0 || C == 0) return out;
  const int64_t blocks = (C + kChannels - 1) / kChannels;
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* sp = conv_state.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ldx = x.stride(0), per_slot = C * (K - 1);
    // Jobs block-major: a thread's run of jobs (a channel block over many decode rows)
    // widens the block's weights once.
    tmpar::parallel_for(0, n * blocks, 1, [&](int64_t j0, int64_t j1) {
      float wt[kMaxK][kChannels];
      int64_t have = -1;
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t b = j / n, seq = j % n, c0 = b * kChannels;
        const int64_t width = std::min(C, c0 + kChannels) - c0;
        if (b != have) {
          for (int64_t k = 0; k < K; ++k)
            for (int64_t c = 0; c < width; ++c) wt[k][c] = static_cast<float>(wp[(c0 + c) * K + k]);
          have = b;
        }
        conv_channels<scalar_t>(xp, ldx, wt, K, sp + rd[seq] * per_slot, sp + wr[seq] * per_slot,
                                C, cu[seq], cu[seq + 1], c0, width, op, C);
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "causal_conv1d_silu: float32, bfloat16 or float16 only");
  }
  return out;
}
