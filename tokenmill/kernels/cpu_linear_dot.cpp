// linear_bf16's many-row path on native bf16 dot products (vdpbf16ps), built at the
// avx512_bf16 level only (elsewhere linear_bf16_dot_rows() is 0 and nothing here runs).
//
// Why: linear_bf16 widens the packed bf16 weights to fp32 and multiplies with fp32
// FMAs, which is right for decode (a step streams the weights; widening is free
// there) but does half the work per instruction of vdpbf16ps once a call has enough
// rows to be bound by arithmetic. With this path the packed copy serves batched
// decode and prefill at oneDNN's bf16 speed, so no second, oneDNN-prepacked copy
// of the weights is needed (tokenmill/platforms/cpu.py).
//
// Per call, per 32-column block of the packed layout ([K, 32] bf16, each k line
// interleaved as (col i, col 16 + i) pairs; cpu_linear.cpp), the block is
// re-interleaved once into k-pair order in a per-thread scratch: pair word p of
// column c is (w[2p][c], w[2p + 1][c]) (an odd K's last pair is (w[K-1][c], 0)),
// 32 words per p as two 16-lane vectors (columns 0..15, 16..31). bf16 rows of x
// are already pair words (x[2p], x[2p + 1]) in memory. The micro-kernel keeps
// DMR x 32 fp32 accumulators and, per pair p, broadcasts each row's pair word and
// does two vdpbf16ps: products of bf16s are exact in fp32, sums are fp32.
//
// Cache blocking: a thread takes a group of up to G column blocks (their scratch,
// G * K * 64 bytes, stays in L2), and runs row chunks of MC rows (MC * K * 2 bytes of
// x, in L2) across every block of the group.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
namespace {

constexpr int64_t NB = 32;   // columns per packed block (cpu_linear.cpp)
constexpr int DMR = 12;      // rows per micro-kernel: 24 accumulators + 2 weights + 1 broadcast
constexpr int64_t MIN_ROWS = 9;             // decode (<= 8 rows) keeps linear_bf16's own path
constexpr int64_t X_CHUNK_BYTES = 192 << 10;  // x rows of one row chunk
constexpr int64_t W_GROUP_BYTES = 256 << 10;  // pair scratch of one column-block group
constexpr int64_t MAX_GROUP = 8;

// One packed block [K, 32] -> pair words [ceil(K/2), 32] (see the top of the file).
inline void pair_block(const uint16_t* wb, int64_t K, uint32_t* dst) {
  constexpr __mmask32 kHigh = 0xAAAAAAAAu;  // the high bf16 of every dword
  const int64_t K2 = K / 2;
  for (int64_t p = 0; p < K2; ++p) {
    // a: line 2p, b: line 2p + 1; dword i of a line = (col i, col 16 + i).
    const __m512i a = _mm512_loadu_si512(wb + 2 * p * NB);
    const __m512i b = _mm512_loadu_si512(wb + (2 * p + 1) * NB);
    const __m512i lo = _mm512_mask_blend_epi16(kHigh, a, _mm512_slli_epi32(b, 16));
    const __m512i hi = _mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(a, 16), b);
    _mm512_storeu_si512(dst + p * NB, lo);
    _mm512_storeu_si512(dst + p * NB + 16, hi);
  }
  if (K & 1) {  // the last line pairs with zeros
    const __m512i a = _mm512_loadu_si512(wb + (K - 1) * NB);
    _mm512_storeu_si512(dst + K2 * NB, _mm512_and_si512(a, _mm512_set1_epi32(0xffff)));
    _mm512_storeu_si512(dst + K2 * NB + 16, _mm512_srli_epi32(a, 16));
  }
}

// R rows of pair words x (row stride ldx words) against one block's pair scratch w
// over K2 pairs; + bias (or null) -> fp32 y or (yf null) bf16 yb, ncols real columns.
template <int R>
inline void dot_micro(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t K2,
                      const float* bias, float* yf, c10::BFloat16* yb, int64_t ldy,
                      int64_t ncols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * NB);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * NB + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int c = 0; c < 2; ++c) {
    const int n = static_cast<int>(std::clamp<int64_t>(ncols - 16 * c, 0, 16));
    if (n == 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * c)
                                     : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const tmvec::Vec v(_mm512_add_ps(acc[r][c], b));
      if (yf != nullptr) {
        _mm512_mask_storeu_ps(yf + r * ldy + 16 * c, mask, v.v);
      } else {  // c10's rounding (nearest even), as linear_bf16's other paths store
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v.round_bf16().v), 16);
        _mm256_mask_storeu_epi16(yb + r * ldy + 16 * c, mask, _mm512_cvtepi32_epi16(bits));
      }
    }
  }
}

template <int R>
inline void dot_tail(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t K2,
                     const float* bias, float* yf, c10::BFloat16* yb, int64_t ldy,
                     int64_t rows, int64_t ncols) {
  // rows < R here: the micro-kernel of exactly that many rows.
  if constexpr (R > 1) {
    if (rows == R - 1) return dot_micro<R - 1>(x, ldx, w, K2, bias, yf, yb, ldy, ncols);
    return dot_tail<R - 1>(x, ldx, w, K2, bias, yf, yb, ldy, rows, ncols);
  }
}

// `rows` rows of x against one block's pair scratch; outputs at yf / yb (stride ldy).
inline void dot_rows(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t K2,
                     const float* bias, float* yf, c10::BFloat16* yb, int64_t ldy, int64_t rows,
                     int64_t ncols) {
  int64_t m = 0;
  for (; m + DMR <= rows; m += DMR)
    dot_micro<DMR>(x + m * ldx, ldx, w, K2, bias, yf ? yf + m * ldy : nullptr,
                   yb ? yb + m * ldy : nullptr, ldy, ncols);
  if (m < rows)
    dot_tail<DMR>(x + m * ldx, ldx, w, K2, bias, yf ? yf + m * ldy : nullptr,
                  yb ? yb + m * ldy : nullptr, ldy, rows - m, ncols);
}

// x [M, K] bf16 as pair words [M, ceil(K/2)]: the tensor's own memory when K is even,
// else a copy with each row's last word (x[K-1], 0) (`hold` keeps it).
inline const uint32_t* pair_rows(const c10::BFloat16* x, int64_t M, int64_t K,
                                 std::vector<uint32_t>& hold) {
  if (K % 2 == 0) return reinterpret_cast<const uint32_t*>(x);
  const int64_t K2 = (K + 1) / 2;
  hold.resize(M * K2);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(hold.data() + m * K2, x + m * K, (K - 1) * sizeof(uint16_t));
    hold[m * K2 + K2 - 1] = x[m * K + K - 1].x;
  }
  return hold.data();
}

std::vector<uint32_t>& thread_scratch(int64_t words) {
  thread_local std::vector<uint32_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < words) scratch.resize(words);
  return scratch;
}

}  // namespace

int64_t linear_bf16_dot_rows() { return MIN_ROWS; }

void linear_bf16_dot(const c10::BFloat16* x, int64_t M, int64_t K, const uint16_t* packed,
                     int64_t N, const float* bias, float* yf, c10::BFloat16* yb) {
  const int64_t K2 = (K + 1) / 2, nblocks = (N + NB - 1) / NB, block_words = K2 * NB;
  std::vector<uint32_t> hold;
  const uint32_t* xp = pair_rows(x, M, K, hold);
  const int64_t nthreads = at::get_num_threads();
  // Blocks per group: what fits the scratch budget, and at least two groups a thread.
  int64_t G = std::clamp<int64_t>(W_GROUP_BYTES / (block_words * 4), 1, MAX_GROUP);
  G = std::max<int64_t>(1, std::min(G, nblocks / (2 * nthreads)));
  const int64_t ngroups = (nblocks + G - 1) / G;
  const int64_t MC = std::max<int64_t>(DMR, X_CHUNK_BYTES / (K2 * 4) / DMR * DMR);
  // Too few groups for the threads (narrow layers): split the rows too.
  const int64_t row_groups = (M + DMR - 1) / DMR;
  const int64_t parts =
      ngroups >= nthreads ? 1 : std::min(row_groups, (nthreads + ngroups - 1) / ngroups);
  const int64_t part_rows = (row_groups + parts - 1) / parts * DMR;
  at::parallel_for(0, ngroups * parts, 1, [&](int64_t i0, int64_t i1) {
    uint32_t* scratch = thread_scratch(G * block_words).data();
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / parts, part = item % parts;
      const int64_t r0 = part * part_rows, r1 = std::min(M, r0 + part_rows);
      const int64_t b0 = g * G, b1 = std::min(nblocks, b0 + G);
      if (r0 >= r1) continue;
      for (int64_t b = b0; b < b1; ++b)
        pair_block(packed + b * K * NB, K, scratch + (b - b0) * block_words);
      for (int64_t m0 = r0; m0 < r1; m0 += MC) {
        const int64_t rows = std::min(MC, r1 - m0);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * NB;
          dot_rows(xp + m0 * K2, K2, scratch + (b - b0) * block_words, K2,
                   bias != nullptr ? bias + n0 : nullptr, yf ? yf + m0 * N + n0 : nullptr,
                   yb ? yb + m0 * N + n0 : nullptr, N, rows, std::min(NB, N - n0));
        }
      }
    }
  });
}

void linear_bf16_dot_block(const c10::BFloat16* x, int64_t rows, int64_t K,
                           const uint16_t* wblock, float* y, int64_t ldy, int64_t ncols) {
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint32_t> hold, scratch(K2 * NB);
  const uint32_t* xp = pair_rows(x, rows, K, hold);
  pair_block(wblock, K, scratch.data());
  dot_rows(xp, K2, scratch.data(), K2, nullptr, y, nullptr, ldy, rows, ncols);
}

#else  // no native bf16 dot products at this level: linear_bf16 never calls these

int64_t linear_bf16_dot_rows() { return 0; }

void linear_bf16_dot(const c10::BFloat16*, int64_t, int64_t, const uint16_t*, int64_t,
                     const float*, float*, c10::BFloat16*) {
  TORCH_CHECK(false, "linear_bf16_dot: not built at this level (", TOKENMILL_CPU_LEVEL_NAME, ")");
}

void linear_bf16_dot_block(const c10::BFloat16*, int64_t, int64_t, const uint16_t*, float*,
                           int64_t, int64_t) {
  TORCH_CHECK(false, "linear_bf16_dot_block: not built at this level (",
              TOKENMILL_CPU_LEVEL_NAME, ")");
}

#endif
