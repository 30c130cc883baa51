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
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t NB = 32;   // output columns per packed block
constexpr int64_t MR = 12;   // rows per micro-kernel call (24 accumulators)
constexpr int64_t MC = 128;  // rows per cache block: x rows stay in L2 across column blocks

#if defined(__AVX512F__)
// W is either the packed bf16 block (widened per k) or, when many row groups
// reuse the block, a copy already widened to fp32 [K, 32] (plain loads, no ALU
// work between the FMAs). `accumulate`: add to y instead of overwriting it (the
// second and later K chunks); `bias` (or null) is added by the last chunk.
template <int R, bool WIDE>
inline void micro(const float* x, int64_t ldx, const void* wblock, int64_t K, const float* bias,
                  float* y, int64_t ldy, int64_t ncols, bool accumulate = false) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const __m512i mask_hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const auto* wp = static_cast<const uint16_t*>(wblock);
  const auto* wf = static_cast<const float*>(wblock);
  for (int64_t k = 0; k < K; ++k) {
    __m512 w_lo, w_hi;
    if constexpr (WIDE) {
      w_lo = _mm512_loadu_ps(wf + k * NB);
      w_hi = _mm512_loadu_ps(wf + k * NB + 16);
    } else {
      // Few rows: still bound by streaming the weights (see micro_row).
      _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 128) * NB), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(wp + k * NB);
      w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      w_hi = _mm512_castsi512_ps(_mm512_and_si512(w, mask_hi));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
  const __mmask16 m_lo = ncols >= 16 ? 0xffff : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m_hi = ncols >= 32 ? 0xffff
                         : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
  if (bias != nullptr) {
    b_lo = _mm512_maskz_loadu_ps(m_lo, bias);
    b_hi = _mm512_maskz_loadu_ps(m_hi, bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    __m512 a_lo = _mm512_add_ps(lo[r], b_lo), a_hi = _mm512_add_ps(hi[r], b_hi);
    if (accumulate) {
      a_lo = _mm512_add_ps(a_lo, _mm512_maskz_loadu_ps(m_lo, yr));
      a_hi = _mm512_add_ps(a_hi, _mm512_maskz_loadu_ps(m_hi, yr + 16));
    }
    _mm512_mask_storeu_ps(yr, m_lo, a_lo);
    _mm512_mask_storeu_ps(yr + 16, m_hi, a_hi);
  }
}

// One row of x against one column block, with four independent accumulator
// pairs so a lone decode row is not serialised on FMA latency.
inline void micro_row(const float* x, const uint16_t* wp, int64_t K, const float* bias, float* y,
                      int64_t ncols) {
  __m512 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  const __m512i mask_hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    // A lone row is bound by memory: keep requests for lines ~8 KB ahead in flight.
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 128) * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 129) * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 130) * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 131) * NB), _MM_HINT_T0);
    for (int i = 0; i < 4; ++i) {
      const __m512i w = _mm512_loadu_si512(wp + (k + i) * NB);
      const __m512 xv = _mm512_set1_ps(x[k + i]);
      lo[i] = _mm512_fmadd_ps(xv, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), lo[i]);
      hi[i] = _mm512_fmadd_ps(xv, _mm512_castsi512_ps(_mm512_and_si512(w, mask_hi)), hi[i]);
    }
  }
  for (; k < K; ++k) {
    const __m512i w = _mm512_loadu_si512(wp + k * NB);
    const __m512 xv = _mm512_set1_ps(x[k]);
    lo[0] = _mm512_fmadd_ps(xv, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), lo[0]);
    hi[0] = _mm512_fmadd_ps(xv, _mm512_castsi512_ps(_mm512_and_si512(w, mask_hi)), hi[0]);
  }
  const __m512 sum_lo = _mm512_add_ps(_mm512_add_ps(lo[0], lo[1]), _mm512_add_ps(lo[2], lo[3]));
  const __m512 sum_hi = _mm512_add_ps(_mm512_add_ps(hi[0], hi[1]), _mm512_add_ps(hi[2], hi[3]));
  float tmp[NB];
  _mm512_storeu_ps(tmp, sum_lo);
  _mm512_storeu_ps(tmp + 16, sum_hi);
  for (int64_t c = 0; c < ncols; ++c) y[c] = tmp[c] + (bias != nullptr ? bias[c] : 0.f);
}

// Widen a packed [K, 32] bf16 block into fp32 [K, 32] (columns 0..15, then 16..31).
inline void widen_block(const uint16_t* wp, int64_t K, float* wf) {
  const __m512i mask_hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 128) * NB), _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(wp + k * NB);
    _mm512_storeu_si512(wf + k * NB, _mm512_slli_epi32(w, 16));
    _mm512_storeu_si512(wf + k * NB + 16, _mm512_and_si512(w, mask_hi));
  }
}

// Rows from this many up widen the block once instead of per row group.
constexpr int64_t WIDEN_MIN_ROWS = 24;
// K chunk of the widened path: 256 x 32 fp32 weights (32 KB) stay in L1 while
// every row group of the cache block passes over them.
constexpr int64_t KC = 256;

template <bool WIDE>
inline void rows_of(const float* x, int64_t ldx, int64_t K, const void* w, const float* bias,
                    float* y, int64_t N, int64_t rows, int64_t ncols, bool accumulate) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR)
    micro<MR, WIDE>(x + m * ldx, ldx, w, K, bias, y + m * N, N, ncols, accumulate);
  const float* xr = x + m * ldx;
  float* yr = y + m * N;
  switch (rows - m) {
    case 11: micro<11, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 10: micro<10, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 9: micro<9, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 8: micro<8, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 7: micro<7, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 6: micro<6, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 5: micro<5, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 4: micro<4, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 3: micro<3, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 2: micro<2, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    case 1: micro<1, WIDE>(xr, ldx, w, K, bias, yr, N, ncols, accumulate); break;
    default: break;
  }
}

inline void block_rows(const float* x, int64_t K, const uint16_t* wp, const float* bias, float* y,
                       int64_t N, int64_t rows, int64_t ncols, std::vector<float>& scratch) {
  if (rows == 1) return micro_row(x, wp, K, bias, y, ncols);
  if (rows < WIDEN_MIN_ROWS) return rows_of<false>(x, K, K, wp, bias, y, N, rows, ncols, false);
  scratch.resize(K * NB);
  widen_block(wp, K, scratch.data());
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    rows_of<true>(x + k0, K, kc, scratch.data() + k0 * NB, k0 + kc == K ? bias : nullptr, y, N,
                  rows, ncols, k0 > 0);
  }
}
#endif

// fp32 <-> bf16 for a run of n values (round to nearest even, as c10::BFloat16).
inline void to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(dst + i, _mm512_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
inline void from_bf16(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace

// One packed column block for `rows` rows, computed exactly as linear_bf16 computes
// it for a cache block of that many rows (the greedy lm_head recomputes its
// candidate blocks with this, so its logits are bit-identical). No bias.
void linear_bf16_block(const float* x, int64_t K, const uint16_t* wblock, float* y, int64_t ldy,
                       int64_t rows, int64_t ncols) {
#if defined(__AVX512F__)
  std::vector<float> scratch;
  block_rows(x, K, wblock, nullptr, y, ldy, rows, ncols, scratch);
#else
  TORCH_CHECK(false, "linear_bf16_block needs AVX-512: this is the ", TOKENMILL_CPU_LEVEL_NAME,
              " build of the kernels");
#endif
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
  // bf16 rows are widened here, without an ATen op (a decode step has 33 of these).
  torch::Tensor xc = x.contiguous();
  std::vector<float> xbuf;
  const float* xp;
  if (out_dtype == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    xbuf.resize(M * K);
    from_bf16(xc.data_ptr<c10::BFloat16>(), xbuf.data(), M * K);
    xp = xbuf.data();
  }
  const float* bp = nullptr;
  torch::Tensor bf;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == N, "linear_bf16: bias must be [N]");
    bf = bias.to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  torch::Tensor out = torch::empty({M, N}, x.options());
  // fp32 results go straight to `out`; bf16 ones through a per-block fp32 tile.
  float* yp = out_dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
#if defined(__AVX512F__)
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> tile(yp == nullptr ? rows * NB : 0), scratch;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
        const float* bias_b = bp != nullptr ? bp + n0 : nullptr;
        if (yp != nullptr) {
          block_rows(xp + m0 * K, K, wp + b * K * NB, bias_b, yp + m0 * N + n0, N, rows, ncols,
                     scratch);
        } else {
          block_rows(xp + m0 * K, K, wp + b * K * NB, bias_b, tile.data(), NB, rows, ncols, scratch);
          auto* ob = out.data_ptr<c10::BFloat16>() + m0 * N + n0;
          for (int64_t r = 0; r < rows; ++r) to_bf16(tile.data() + r * NB, ob + r * N, ncols);
        }
      }
    });
  }
#else
  // Portable path: unpack and use the library GEMM.
  auto w = packed.view({nblocks, K, 16, 2}).permute({0, 3, 2, 1}).reshape({nblocks * NB, K}).narrow(0, 0, N).to(at::kFloat);
  auto res = torch::matmul(x.to(at::kFloat), w.t());
  if (bp != nullptr) res.add_(bf);
  out.copy_(res);
#endif
  return out;
}
