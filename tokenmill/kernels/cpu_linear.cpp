// y = x @ w^T + b with bf16 weights, fp32 math, for CPUs without native bf16.
//
// Why: oneDNN emulates bf16 GEMMs there (~60 GFLOP/s), and an fp32 copy of the
// weights doubles the bytes a decode step streams from memory (a batch-1 step
// is bound by reading the weights). This kernel keeps the weights in bf16 and
// widens them in registers; a bf16 is the top half of an fp32, so widening is
// exact and the math equals an fp32 GEMM over the upcast weights.
//
// Packed layout, made once at load (pack_bf16_weight): [N/32, K, 32] bf16. For
// each block of 32 output columns and each k, the 32 weights sit in one 64-byte
// line, interleaved as (col i, col 16+i) pairs: read as 16 dwords, `dword << 16`
// is columns 0..15 in fp32 and `dword & 0xffff0000` is columns 16..31. That is
// two cheap ALU ops per 32 weights and no horizontal sums: the micro-kernel
// broadcasts x[m, k] and does outer-product FMAs into MR x 32 accumulators.
// The layout is the same at every capability level: a W-lane vector of dwords
// (W = 16, 8 or 4) yields W columns from its low halves and the W columns 16
// further on from its high halves (vec.h's load_bf16_pairs).
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace {

using tmvec::Vec;

constexpr int64_t NB = 32;            // output columns per packed block
constexpr int C = NB / Vec::W;        // vectors per block row (2 at AVX-512, 4 at AVX2)
constexpr int H = C / 2;              // packed dword vectors per k (each gives a lo and a hi)
// Rows per micro-kernel call: as many MR x C accumulators as the registers hold
// with room for the weights and the broadcast (AVX-512: 12 x 2; AVX2: 3 x 4; NEON 3 x 8).
constexpr int MR = Vec::kRegs == 32 ? (C == 2 ? 12 : 3) : (C >= 4 ? 3 : 6);
constexpr int64_t MC = 128;  // rows per cache block: x rows stay in L2 across column blocks

// How many of vector c's W columns are real when the block has ncols columns.
inline int lanes(int64_t ncols, int c) {
  return static_cast<int>(std::clamp<int64_t>(ncols - c * Vec::W, 0, Vec::W));
}

// The C vectors of weights at k: vector c holds columns c*W .. c*W+W-1. In the
// packed layout dword i of a k line is (col i, col 16+i), so packed dword vector j
// gives vector j (its low halves) and vector j + H (its high halves).
template <bool WIDE>
inline void weights_at(const void* wblock, int64_t k, Vec* w) {
  if constexpr (WIDE) {
    const auto* wf = static_cast<const float*>(wblock) + k * NB;
    for (int c = 0; c < C; ++c) w[c] = Vec::load(wf + c * Vec::W);
  } else {
    const auto* wp = static_cast<const uint16_t*>(wblock) + k * NB;
    for (int j = 0; j < H; ++j) tmvec::load_bf16_pairs(wp + 2 * j * Vec::W, w[j], w[j + H]);
  }
}

// W is either the packed bf16 block (widened per k) or, when many row groups
// reuse the block, a copy already widened to fp32 [K, 32] (plain loads, no ALU
// work between the FMAs). `accumulate`: add to y instead of overwriting it (the
// second and later K chunks); `bias` (or null) is added by the last chunk.
template <int R, bool WIDE>
inline void micro(const float* x, int64_t ldx, const void* wblock, int64_t K, const float* bias,
                  float* y, int64_t ldy, int64_t ncols, bool accumulate = false) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    // Few rows: still bound by streaming the weights (see micro_row).
    if constexpr (!WIDE) tmvec::prefetch(static_cast<const uint16_t*>(wblock) + (k + 128) * NB);
    Vec w[C];
    weights_at<WIDE>(wblock, k, w);
    for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::set1(x[r * ldx + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = tmvec::fma(xv, w[c], acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int n = lanes(ncols, c);
    if (n == 0) continue;
    const Vec b = bias != nullptr ? Vec::load_n(bias + c * Vec::W, n) : Vec::zero();
    for (int r = 0; r < R; ++r) {
      float* yr = y + r * ldy + c * Vec::W;
      Vec a = acc[r][c] + b;
      if (accumulate) a = a + Vec::load_n(yr, n);
      if (n == Vec::W) a.store(yr); else a.store_n(yr, n);
    }
  }
}

// One row of x against one column block, with U independent accumulator sets over
// k (8 vectors in all) so a lone decode row is not serialised on FMA latency. The
// block is packed bf16 or (WIDE) packed fp32 [K, 32] (linear_f32).
template <bool WIDE>
inline void micro_row(const float* x, const void* wblock, int64_t K, const float* bias, float* y,
                      int64_t ncols) {
  constexpr int U = C >= 8 ? 1 : 8 / C;
  using T = std::conditional_t<WIDE, float, uint16_t>;
  const T* wp = static_cast<const T*>(wblock);
  Vec acc[U][C];
  for (int u = 0; u < U; ++u)
    for (int c = 0; c < C; ++c) acc[u][c] = Vec::zero();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    // A lone row is bound by memory: keep requests for lines 8 KB (bf16) or 16 KB
    // (fp32) ahead in flight; fp32 lines are 128 bytes per k, two per prefetch step.
    for (int i = 0; i < 4; ++i) {
      tmvec::prefetch(wp + (k + 128 + i) * NB);
      if constexpr (WIDE) tmvec::prefetch(wp + (k + 128 + i) * NB + 16);
    }
    for (int i = 0; i < 4; ++i) {
      Vec w[C];
      weights_at<WIDE>(wp, k + i, w);
      const Vec xv = Vec::set1(x[k + i]);
      for (int c = 0; c < C; ++c) acc[i % U][c] = tmvec::fma(xv, w[c], acc[i % U][c]);
    }
  }
  for (; k < K; ++k) {
    Vec w[C];
    weights_at<WIDE>(wp, k, w);
    const Vec xv = Vec::set1(x[k]);
    for (int c = 0; c < C; ++c) acc[0][c] = tmvec::fma(xv, w[c], acc[0][c]);
  }
  for (int c = 0; c < C; ++c) {
    const int n = lanes(ncols, c);
    if (n == 0) continue;
    Vec sum = acc[0][c];
    for (int u = 1; u < U; ++u) sum = sum + acc[u][c];
    if (bias != nullptr) sum = sum + Vec::load_n(bias + c * Vec::W, n);
    if (n == Vec::W) sum.store(y + c * Vec::W); else sum.store_n(y + c * Vec::W, n);
  }
}

// Widen a packed [K, 32] bf16 block into fp32 [K, 32] (columns in order).
inline void widen_block(const uint16_t* wp, int64_t K, float* wf) {
  for (int64_t k = 0; k < K; ++k) {
    tmvec::prefetch(wp + (k + 128) * NB);
    Vec w[C];
    weights_at<false>(wp, k, w);
    for (int c = 0; c < C; ++c) w[c].store(wf + k * NB + c * Vec::W);
  }
}

// Rows from this many up widen the block once instead of per row group.
constexpr int64_t WIDEN_MIN_ROWS = 24;
// K chunk of the widened path: 256 x 32 fp32 weights (32 KB) stay in L1 while
// every row group of the cache block passes over them.
constexpr int64_t KC = 256;

template <bool WIDE, int R>
inline void rows_tail(const float* x, int64_t ldx, int64_t K, const void* w, const float* bias,
                      float* y, int64_t N, int64_t rows, int64_t ncols, bool accumulate) {
  // rows < R here: dispatch to the micro-kernel of exactly that many rows.
  if constexpr (R > 1) {
    if (rows == R - 1) return micro<R - 1, WIDE>(x, ldx, w, K, bias, y, N, ncols, accumulate);
    return rows_tail<WIDE, R - 1>(x, ldx, K, w, bias, y, N, rows, ncols, accumulate);
  }
}

template <bool WIDE>
inline void rows_of(const float* x, int64_t ldx, int64_t K, const void* w, const float* bias,
                    float* y, int64_t N, int64_t rows, int64_t ncols, bool accumulate) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR)
    micro<MR, WIDE>(x + m * ldx, ldx, w, K, bias, y + m * N, N, ncols, accumulate);
  if (m < rows)
    rows_tail<WIDE, MR>(x + m * ldx, ldx, K, w, bias, y + m * N, N, rows - m, ncols, accumulate);
}

inline void block_rows(const float* x, int64_t K, const uint16_t* wp, const float* bias, float* y,
                       int64_t N, int64_t rows, int64_t ncols, std::vector<float>& scratch) {
  if (rows == 1) return micro_row<false>(x, wp, K, bias, y, ncols);
  if (rows < WIDEN_MIN_ROWS) return rows_of<false>(x, K, K, wp, bias, y, N, rows, ncols, false);
  scratch.resize(K * NB);
  widen_block(wp, K, scratch.data());
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    rows_of<true>(x + k0, K, kc, scratch.data() + k0 * NB, k0 + kc == K ? bias : nullptr, y, N,
                  rows, ncols, k0 > 0);
  }
}

// A packed fp32 block [K, 32] is already in the widened layout: one row streams it
// with prefetches; more rows go over it in K chunks that stay in L1.
inline void block_rows_f32(const float* x, int64_t K, const float* wf, const float* bias,
                           float* y, int64_t N, int64_t rows, int64_t ncols) {
  if (rows == 1) return micro_row<true>(x, wf, K, bias, y, ncols);
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    rows_of<true>(x + k0, K, kc, wf + k0 * NB, k0 + kc == K ? bias : nullptr, y, N, rows,
                  ncols, k0 > 0);
  }
}

// bias [N] (any float dtype) or empty -> fp32 values (`hold` keeps them alive), or null.
inline const float* bias_f32(const torch::Tensor& bias, int64_t N, const char* op,
                             torch::Tensor& hold) {
  if (!bias.defined() || bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.numel() == N, op, ": bias must be [N]");
  hold = bias.to(at::kFloat).contiguous();
  return hold.data_ptr<float>();
}

// fp32 <-> bf16 for a run of n values (round to nearest even, as c10::BFloat16).
inline void to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) Vec::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
inline void from_bf16(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) Vec::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace

void widen_bf16(const c10::BFloat16* src, float* dst, int64_t n) {
  at::parallel_for(0, n, 1 << 15, [&](int64_t i0, int64_t i1) {
    from_bf16(src + i0, dst + i0, i1 - i0);
  });
}

// One packed column block for `rows` rows, computed exactly as linear_bf16 computes
// it for a cache block of that many rows (the greedy lm_head recomputes its
// candidate blocks with this, so its logits are bit-identical). No bias.
void linear_bf16_block(const float* x, int64_t K, const uint16_t* wblock, float* y, int64_t ldy,
                       int64_t rows, int64_t ncols, bool x_bf16) {
  const int64_t dot_rows = linear_bf16_dot_rows();
  if (x_bf16 && dot_rows > 0 && rows >= dot_rows) {  // x's values are bf16: exact
    std::vector<c10::BFloat16> xb(rows * K);
    to_bf16(x, xb.data(), rows * K);
    return linear_bf16_dot_block(xb.data(), rows, K, wblock, y, ldy, ncols);
  }
  std::vector<float> scratch;
  block_rows(x, K, wblock, nullptr, y, ldy, rows, ncols, scratch);
}

// The same for a packed fp32 block, exactly as linear_f32 computes it.
void linear_f32_block(const float* x, int64_t K, const float* wblock, float* y, int64_t ldy,
                      int64_t rows, int64_t ncols) {
  block_rows_f32(x, K, wblock, nullptr, y, ldy, rows, ncols);
}

// w [N, K] bf16 -> [ceil(N/32), K, 32] bf16 in the kernel's interleaved layout (zero padded).
torch::Tensor pack_bf16_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16_weight: [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1), nb = (N + NB - 1) / NB;
  auto padded = torch::zeros({nb * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [nb, 2, 16, K] -> [nb, K, 16, 2]: pair i of a line is (col i, col 16 + i).
  return padded.view({nb, 2, 16, K}).permute({0, 3, 2, 1}).reshape({nb, K, NB}).contiguous();
}

// x [M, K] fp32 or bf16, packed from pack_bf16_weight, N the real column count,
// bias [N] fp32 or empty -> [M, N] in x's dtype.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "linear_bf16: weights must come from pack_bf16_weight");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1), "linear_bf16: x must be [M, K]");
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NB, "linear_bf16: bad column count");
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "linear_bf16: x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), nblocks = packed.size(0);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  torch::Tensor bf;
  const float* bp = bias_f32(bias, N, "linear_bf16", bf);
  const int64_t dot_rows = linear_bf16_dot_rows();
  if (out_dtype == at::kBFloat16 && dot_rows > 0 && M >= dot_rows) {
    // Many bf16 rows at a level with bf16 dot products (cpu_linear_dot.cpp).
    torch::Tensor xc = x.contiguous();
    torch::Tensor out = torch::empty({M, N}, x.options());
    linear_bf16_dot(xc.data_ptr<c10::BFloat16>(), M, K, wp, N, bp, nullptr,
                    out.data_ptr<c10::BFloat16>());
    return out;
  }
  // bf16 rows are widened here, without an ATen op (a decode step has 33 of these), a
  // row chunk at a time, into the calling thread's buffer of MC x K floats reused from
  // call to call (a whole prefill-sized input widened into a fresh allocation by one
  // thread page-faulted on every call).
  torch::Tensor xc = x.contiguous();
  thread_local std::vector<float> xbuf;
  if (out_dtype != at::kFloat && static_cast<int64_t>(xbuf.size()) < std::min(M, MC) * K)
    xbuf.resize(std::min(M, MC) * K);
  torch::Tensor out = torch::empty({M, N}, x.options());
  // fp32 results go straight to `out`; bf16 ones through a per-block fp32 tile.
  float* yp = out_dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    const float* xp;
    if (out_dtype == at::kFloat) {
      xp = xc.data_ptr<float>() + m0 * K;
    } else {
      widen_bf16(xc.data_ptr<c10::BFloat16>() + m0 * K, xbuf.data(), rows * K);
      xp = xbuf.data();
    }
    tmpar::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      // (per thread, reused: the widened block of K = 1536 is 192 KB, past malloc's
      // threshold for a fresh mapping)
      thread_local std::vector<float> tile, scratch;
      if (yp == nullptr && static_cast<int64_t>(tile.size()) < rows * NB) tile.resize(rows * NB);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
        const float* bias_b = bp != nullptr ? bp + n0 : nullptr;
        if (yp != nullptr) {
          block_rows(xp, K, wp + b * K * NB, bias_b, yp + m0 * N + n0, N, rows, ncols,
                     scratch);
        } else {
          block_rows(xp, K, wp + b * K * NB, bias_b, tile.data(), NB, rows, ncols, scratch);
          auto* ob = out.data_ptr<c10::BFloat16>() + m0 * N + n0;
          for (int64_t r = 0; r < rows; ++r) to_bf16(tile.data() + r * NB, ob + r * N, ncols);
        }
      }
    });
  }
  return out;
}

// w [N, K] fp32 -> [ceil(N/32), K, 32] fp32, columns in order (zero padded).
torch::Tensor pack_f32_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_f32_weight: [N, K] fp32");
  const int64_t N = w.size(0), K = w.size(1), nb = (N + NB - 1) / NB;
  auto padded = torch::zeros({nb * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({nb, NB, K}).permute({0, 2, 1}).contiguous();
}

// x [M, K] fp32, packed from pack_f32_weight, N the real column count, bias [N] fp32
// or empty -> [M, N] fp32. Why: at batch 1 a GEMV streams the weights from memory,
// and this kernel keeps several KB of them in flight (~4x what F.linear reaches on
// the machines measured; docs/benchmarks.md).
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "linear_f32: weights must come from pack_f32_weight");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) && x.scalar_type() == at::kFloat,
              "linear_f32: x must be [M, K] fp32");
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NB, "linear_f32: bad column count");
  const int64_t M = x.size(0), K = x.size(1), nblocks = packed.size(0);
  torch::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  torch::Tensor bf;
  const float* bp = bias_f32(bias, N, "linear_f32", bf);
  torch::Tensor out = torch::empty({M, N}, x.options());
  float* yp = out.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    tmpar::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
        block_rows_f32(xp + m0 * K, K, wp + b * K * NB, bp != nullptr ? bp + n0 : nullptr,
                       yp + m0 * N + n0, N, rows, ncols);
      }
    });
  }
  return out;
}
