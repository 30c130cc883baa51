// The depthwise causal conv1d + SiLU in front of Gated DeltaNet's delta rule (Qwen3.5 /
// Qwen3-Next), for every sequence of a call (a prompt chunk, a batch of decode rows),
// each continuing from the last K - 1 inputs its conv state slot holds.
//
// Token-major and vectorised over channels: out[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]),
// the inputs before the chunk read from the state, the chunk's last K - 1 inputs left
// in the state. Rounded as the PyTorch path rounds it (F.conv1d in the model dtype,
// then F.silu): the sum in fp32 rounded to the dtype, silu of that in fp32 rounded
// again. That path transposed the chunk to channel-major, concatenated the state in
// front, convolved and transposed back: ~8 ms a layer for 2,000 tokens of 1,024
// channels in bf16 on 2 cores, where this reads each input K times from L1.
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

// Channels [c0, c1) of one sequence: tokens [t0, t1) of x, history from state row
// `rd`, the last K - 1 inputs into state row `wr` (both [C, K - 1] in the cache).
template <typename T>
void conv_channels(const T* x, int64_t ldx, const T* w, int64_t K, T* state_rd, T* state_wr,
                   int64_t t0, int64_t t1, int64_t c0, int64_t c1, T* out, int64_t ldo) {
  const int64_t n = c1 - c0, km1 = K - 1, L = t1 - t0;
  // The history and the weights channel-innermost, fp32: hist[j][c], wt[j][c].
  float hist[kMaxK][kChannels], wt[kMaxK][kChannels];
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t j = 0; j < km1; ++j) hist[j][c] = static_cast<float>(state_rd[(c0 + c) * km1 + j]);
    for (int64_t j = 0; j < K; ++j) wt[j][c] = static_cast<float>(w[(c0 + c) * K + j]);
  }
  // Input i of the sequence's window (i < 0: the history), channel c.
  auto in = [&](int64_t i, int64_t c) -> float {
    return i >= 0 ? static_cast<float>(x[(t0 + i) * ldx + c0 + c]) : hist[km1 + i][c];
  };
  out += t0 * ldo + c0;
  for (int64_t t = 0; t < L; ++t) {
    int64_t c = 0;
    if (t >= km1) {  // the whole window inside the chunk: vectors straight from x
      Vec largest = Vec::set1(-INFINITY);  // the largest exp argument of the token
      for (; c + W <= n; c += W) {
        Vec acc = Vec::zero();
        for (int64_t j = 0; j < K; ++j)
          acc = tmvec::fma(Vec::load(wt[j] + c),
                           Vec::load(x + (t0 + t - km1 + j) * ldx + c0 + c), acc);
        const Vec y = tmvec::round_to<T>(acc);
        const Vec arg = Vec::zero() - y;
        largest = tmvec::max(largest, arg);
        tmvec::round_to<T>(y / (Vec::set1(1.f) + tmvec::exp(arg))).store(out + t * ldo + c);
      }
      // exp clamps its argument at 88.3 (or a NaN came): the token's channels again
      // with std::exp, as ATen computes them
      if (!(tmvec::reduce_max(largest) <= 88.3f)) c = 0;
    }
    for (; c < n; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < K; ++j) acc = std::fma(wt[j][c], in(t - km1 + j, c), acc);
      out[t * ldo + c] = static_cast<T>(silu_scalar<T>(r<T>(acc)));
    }
  }
  // The state after the chunk: its last K - 1 inputs (the history's tail if shorter).
  float next[kMaxK][kChannels];
  for (int64_t j = 0; j < km1; ++j)
    for (int64_t c = 0; c < n; ++c) next[j][c] = in(L - km1 + j, c);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t j = 0; j < km1; ++j) state_wr[(c0 + c) * km1 + j] = static_cast<T>(next[j][c]);
}

}  // namespace

// x [T, C] (rows of any stride, channels contiguous), conv_state [S, C, K - 1] and
// weight [C, K] contiguous, all one dtype. Sequence n is tokens [cu_seqlens[n],
// cu_seqlens[n + 1]), from conv_state[read_slots[n]] into conv_state[write_slots[n]];
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
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == C && conv_state.size(2) == K - 1 &&
                  conv_state.is_contiguous(),
              "causal_conv1d_silu: conv_state must be contiguous [S, ", C, ", ", K - 1, "], got ",
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
    tmpar::parallel_for(0, n * blocks, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t seq = j / blocks, c0 = j % blocks * kChannels;
        conv_channels<scalar_t>(xp, ldx, wp, K, sp + rd[seq] * per_slot, sp + wr[seq] * per_slot,
                                cu[seq], cu[seq + 1], c0, std::min(C, c0 + kChannels), op, C);
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
