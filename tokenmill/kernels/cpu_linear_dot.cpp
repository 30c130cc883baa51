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
// The driver (linear_dot_gemm) takes its blocks' pair words from a DotPairSource (ops.h):
// linear_bf16's packed blocks here, quantized codes dequantized straight into the
// scratch in cpu_quant_linear.cpp (linear_quant_dot).
//
// Cache blocking: a thread takes a group of up to G column blocks (their scratch,
// G * K * 64 bytes, stays in L2), and runs row chunks of MC rows (MC * K * 2 bytes of
// x, in L2) across every block of the group.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "vec.h"

#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
namespace {

constexpr int64_t NB = 32;   // columns per packed block (cpu_linear.cpp)
constexpr int DMR = 12;      // rows per micro-kernel: 24 accumulators + 2 weights + 1 broadcast
constexpr int64_t MIN_ROWS = 9;             // decode (<= 8 rows) keeps linear_bf16's own path
// This path forks through at::parallel_for, which inside a decode loop's team would run on
// one thread (parallel.h): the teams stop where it starts.
static_assert(MIN_ROWS > tmpar::kTeamMaxRows, "steps that reach this path must open no team");
constexpr int64_t MAX_GROUP = 8;
// Cache blocking (linear_bf16_dot_tuning changes them, for the benchmark's sweeps):
// x rows of one row chunk (L2); the pair scratch of one column-block group (L2);
// pairs per K chunk when K has more than 2 * kc2 pairs; rows up to which the
// micro-kernel re-interleaves the packed block in registers (no scratch): up to 40 rows
// (at most four row groups) that costs less than writing and rereading the scratch,
// measured at 25-40 rows 5-13% faster on one thread, 4-30% on two (bench.linear_rows
// --dot-tuning); at 48 it was no longer ahead everywhere.
struct Tuning {
  int64_t x_chunk_bytes = 192 << 10;
  int64_t w_group_bytes = 256 << 10;
  int64_t kc2 = 256;
  int64_t direct_rows = 40;
};
Tuning tuning;

// Lines 2p and 2p + 1 of a packed block (b zero: an odd K's last line) -> pair words of
// columns 0..15 and 16..31. Dword i of a line is (col i, col 16 + i).
inline void pair_lines(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
  constexpr __mmask32 kHigh = 0xAAAAAAAAu;  // the high bf16 of every dword
  lo = _mm512_mask_blend_epi16(kHigh, a, _mm512_slli_epi32(b, 16));
  hi = _mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(a, 16), b);
}

// Pairs [p0, p0 + np) of one packed block [K, 32] -> pair words [np, 32] (the top of
// the file); a pair past K's end (odd K) is (w[K-1][c], 0).
inline void pair_block(const uint16_t* wb, int64_t K, int64_t p0, int64_t np, uint32_t* dst) {
  for (int64_t p = p0; p < p0 + np; ++p) {
    const __m512i a = _mm512_loadu_si512(wb + 2 * p * NB);
    const __m512i b = 2 * p + 1 < K ? _mm512_loadu_si512(wb + (2 * p + 1) * NB)
                                    : _mm512_setzero_si512();
    __m512i lo, hi;
    pair_lines(a, b, lo, hi);
    _mm512_storeu_si512(dst + (p - p0) * NB, lo);
    _mm512_storeu_si512(dst + (p - p0) * NB + 16, hi);
  }
}

// Where a micro-kernel's results go: fp32 `yf` (null: bf16 `yb`), row stride ldy, plus
// `bias` (or null); `init` (or null, row stride ldi): fp32 partial sums to start from
// (the earlier K chunks).
struct Out {
  const float* init;
  int64_t ldi;
  const float* bias;
  float* yf;
  c10::BFloat16* yb;
  int64_t ldy;
  Out rows_from(int64_t m) const {
    return {init ? init + m * ldi : nullptr, ldi, bias, yf ? yf + m * ldy : nullptr,
            yb ? yb + m * ldy : nullptr, ldy};
  }
};

// R rows of pair words x (row stride ldx words) over np pairs against one block: its
// pair scratch w, or (DIRECT) the packed block itself at line 2 * p0, re-interleaved in
// registers (few rows: cheaper than writing the scratch; `K` then bounds the lines).
// `pf` (or null): np * 128 bytes to prefetch into L2 meanwhile (the packed lines the
// next pair_block call reads, so that it does not wait on memory).
template <int R, bool DIRECT>
inline void dot_micro(const uint32_t* x, int64_t ldx, const void* w, int64_t np, int64_t K,
                      const Out& out, int64_t ncols, const char* pf) {
  __m512 acc[R][2];
  for (int c = 0; c < 2; ++c) {
    const int n = static_cast<int>(std::clamp<int64_t>(ncols - 16 * c, 0, 16));
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < R; ++r)
      acc[r][c] = out.init ? _mm512_maskz_loadu_ps(mask, out.init + r * out.ldi + 16 * c)
                           : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < np; ++p) {
    __m512i lo, hi;
    if constexpr (DIRECT) {
      const auto* wb = static_cast<const uint16_t*>(w);
      _mm_prefetch(reinterpret_cast<const char*>(wb + (2 * p + 64) * NB), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + (2 * p + 65) * NB), _MM_HINT_T0);
      pair_lines(_mm512_loadu_si512(wb + 2 * p * NB),
                 2 * p + 1 < K ? _mm512_loadu_si512(wb + (2 * p + 1) * NB)
                               : _mm512_setzero_si512(),
                 lo, hi);
    } else {
      const auto* wp = static_cast<const uint32_t*>(w) + p * NB;
      lo = _mm512_loadu_si512(wp);
      hi = _mm512_loadu_si512(wp + 16);
    }
    if (pf != nullptr) {
      _mm_prefetch(pf + p * 128, _MM_HINT_T1);
      _mm_prefetch(pf + p * 128 + 64, _MM_HINT_T1);
    }
    const __m512bh w0 = (__m512bh)lo, w1 = (__m512bh)hi;
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
    const __m512 b = out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + 16 * c)
                                         : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const tmvec::Vec v(_mm512_add_ps(acc[r][c], b));
      if (out.yf != nullptr) {
        _mm512_mask_storeu_ps(out.yf + r * out.ldy + 16 * c, mask, v.v);
      } else {  // c10's rounding (nearest even), as linear_bf16's other paths store
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v.round_bf16().v), 16);
        _mm256_mask_storeu_epi16(out.yb + r * out.ldy + 16 * c, mask,
                                 _mm512_cvtepi32_epi16(bits));
      }
    }
  }
}

// The micro-kernel of exactly `rows` (1..R) rows.
template <int R, bool DIRECT>
inline void dot_group(const uint32_t* x, int64_t ldx, const void* w, int64_t np, int64_t K,
                      const Out& out, int64_t rows, int64_t ncols, const char* pf) {
  if (rows == R) return dot_micro<R, DIRECT>(x, ldx, w, np, K, out, ncols, pf);
  if constexpr (R > 1) return dot_group<R - 1, DIRECT>(x, ldx, w, np, K, out, rows, ncols, pf);
}

// `rows` rows of x against one block, in row groups of near-equal size (16 rows: 8 + 8,
// not 12 + 4: a short group leaves the FMA pipes waiting on its few accumulators).
// Each output value is one accumulator over the same pairs in the same order whatever
// the grouping, so results do not depend on it.
// `pf`: as dot_micro's, prefetched by the first row group.
template <bool DIRECT>
inline void dot_rows(const uint32_t* x, int64_t ldx, const void* w, int64_t np, int64_t K,
                     const Out& out, int64_t rows, int64_t ncols, const char* pf = nullptr) {
  const int64_t groups = (rows + DMR - 1) / DMR, base = rows / groups, extra = rows % groups;
  int64_t m = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r = base + (g < extra ? 1 : 0);
    dot_group<DMR, DIRECT>(x + m * ldx, ldx, w, np, K, out.rows_from(m), r, ncols,
                           g == 0 ? pf : nullptr);
    m += r;
  }
}

// A per-thread buffer of at least n values (SLOT: separate buffers of one type).
template <typename T, int SLOT>
T* thread_buffer(int64_t n) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// x [M, K] bf16 as pair words [M, ldx >= ceil(K/2)]: the tensor's own memory, unless K
// is odd (each row's last word must be (x[K-1], 0)) or `spread` is asked for and the row
// stride is a multiple of 2 KB (a micro-kernel reads 12 rows at once: at 2, 4 or 8 KB
// apart they crowd into one or two L1 sets, with the other hyperthread's rows too).
// A copy goes into the calling thread's reused buffer (a fresh allocation of a few MB
// a call page-faulted on every call: with the serial copy, that made the scratch path
// 1.3x slower than the in-register one at 2 threads), 64-byte aligned rows, copied by
// every thread.
inline const uint32_t* pair_rows(const c10::BFloat16* x, int64_t M, int64_t K, bool spread,
                                 int64_t& ldx) {
  const int64_t K2 = (K + 1) / 2;
  ldx = K2;
  if (K % 2 == 0 && !(spread && K2 * 4 % 2048 == 0)) return reinterpret_cast<const uint32_t*>(x);
  ldx = (K2 + 15) / 16 * 16;
  if (ldx * 4 % 2048 == 0) ldx += 16;
  uint32_t* base = thread_buffer<uint32_t, 2>(M * ldx + 16);
  base += (16 - reinterpret_cast<uintptr_t>(base) / 4 % 16) % 16;  // 64-byte aligned
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* row = base + m * ldx;
      std::memcpy(row, x + m * K, K * sizeof(uint16_t));
      if (K & 1) row[K2 - 1] = x[m * K + K - 1].x;
    }
  });
  return base;
}

}  // namespace

int64_t linear_bf16_dot_rows() { return MIN_ROWS; }

std::vector<int64_t> linear_bf16_dot_tuning(std::vector<int64_t> values) {
  std::vector<int64_t> old{tuning.x_chunk_bytes, tuning.w_group_bytes, tuning.kc2,
                           tuning.direct_rows};
  TORCH_CHECK(values.empty() || values.size() == 4,
              "linear_bf16_dot_tuning: [x_chunk_bytes, w_group_bytes, kc2, direct_rows]");
  if (values.size() == 4) {
    TORCH_CHECK(values[0] > 0 && values[1] > 0 && values[2] > 0 && values[3] >= 0,
                "linear_bf16_dot_tuning: sizes must be positive");
    tuning = Tuning{values[0], values[1], values[2], values[3]};
  }
  return old;
}

void linear_dot_gemm(const c10::BFloat16* x, int64_t M, int64_t K, int64_t N,
                     const DotPairSource& w, const float* bias, float* yf, c10::BFloat16* yb) {
#if defined(__AMX_BF16__)
  // The amx level multiplies the same pair words on tiles (cpu_linear_amx.cpp).
  return amx_dot_gemm(x, M, K, N, w, bias, yf, yb, N);
#endif
  const int64_t K2 = (K + 1) / 2, nblocks = (N + NB - 1) / NB;
  const Tuning tn = tuning;
  // Few rows re-interleave a bf16 block in registers; other sources always fill a scratch.
  const uint16_t* packed = w.bf16_blocks();
  const int64_t nthreads = at::get_num_threads();
  const bool direct = packed != nullptr && M <= tn.direct_rows;
  int64_t ldx;
  const uint32_t* xp = pair_rows(x, M, K, !direct, ldx);
  // Long K goes in chunks of kc2 pairs: the group's scratch and a row chunk's x stay in
  // L2; the partial sums wait in an fp32 tile of the item's rows.
  const int64_t kc = K2 > 2 * tn.kc2 && !direct ? tn.kc2 : K2, nchunks = (K2 + kc - 1) / kc;
  // Blocks per group: what fits the scratch budget, and at least two groups a thread.
  int64_t G = std::clamp<int64_t>(tn.w_group_bytes / (kc * NB * 4), 1, MAX_GROUP);
  G = std::max<int64_t>(1, std::min(G, nblocks / (2 * nthreads)));
  const int64_t ngroups = (nblocks + G - 1) / G;
  const int64_t MC = std::max<int64_t>(DMR, tn.x_chunk_bytes / (kc * 4) / DMR * DMR);
  // Too few groups for the threads (narrow layers): split the rows too.
  const int64_t row_groups = (M + DMR - 1) / DMR;
  const int64_t parts =
      ngroups >= nthreads ? 1 : std::min(row_groups, (nthreads + ngroups - 1) / ngroups);
  const int64_t part_rows = (row_groups + parts - 1) / parts * DMR;
  at::parallel_for(0, ngroups * parts, 1, [&](int64_t i0, int64_t i1) {
    uint32_t* scratch = direct ? nullptr : thread_buffer<uint32_t, 0>(G * kc * NB);
    float* tile = nchunks > 1 ? thread_buffer<float, 1>(std::min(M, part_rows) * G * NB)
                              : nullptr;
    const int64_t ldt = G * NB;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / parts, part = item % parts;
      const int64_t r0 = part * part_rows, r1 = std::min(M, r0 + part_rows);
      const int64_t b0 = g * G, b1 = std::min(nblocks, b0 + G);
      if (r0 >= r1) continue;
      if (direct) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * NB;
          const Out out{nullptr, 0, bias ? bias + n0 : nullptr, yf ? yf + r0 * N + n0 : nullptr,
                        yb ? yb + r0 * N + n0 : nullptr, N};
          dot_rows<true>(xp + r0 * ldx, ldx, packed + b * K * NB, K2, K, out, r1 - r0,
                         std::min(NB, N - n0));
        }
        continue;
      }
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t p0 = c * kc, np = std::min(kc, K2 - p0);
        const bool first = c == 0, last = c + 1 == nchunks;
        for (int64_t b = b0; b < b1; ++b) w.pairs(b, p0, np, scratch + (b - b0) * kc * NB);
        for (int64_t m0 = r0; m0 < r1; m0 += MC) {
          const int64_t rows = std::min(MC, r1 - m0);
          for (int64_t b = b0; b < b1; ++b) {
            const int64_t n0 = b * NB;
            // The first row chunk prefetches what pair_block reads next for this block's
            // place in the group: the next K chunk, or the next group's block (bf16
            // blocks only: a quantized block's codes are a fraction of the bytes).
            const int64_t nb = last ? b + G : b;
            const char* pf = packed != nullptr && m0 == r0 && nb < nblocks
                ? reinterpret_cast<const char*>(packed + nb * K * NB +
                                                2 * (last ? 0 : p0 + kc) * NB)
                : nullptr;
            float* t = tile ? tile + (m0 - r0) * ldt + (b - b0) * NB : nullptr;
            // Earlier chunks: partial sums into the tile; the last: bias, y.
            const Out out{first ? nullptr : t, ldt, last && bias ? bias + n0 : nullptr,
                          !last ? t : yf ? yf + m0 * N + n0 : nullptr,
                          last && yb ? yb + m0 * N + n0 : nullptr, last ? N : ldt};
            dot_rows<false>(xp + m0 * ldx + p0, ldx, scratch + (b - b0) * kc * NB, np, K, out,
                            rows, std::min(NB, N - n0), pf);
          }
        }
      }
    }
  });
}

namespace {
// linear_bf16's packed blocks as a pair source.
struct Bf16Pairs final : DotPairSource {
  const uint16_t* packed;
  int64_t K;
  Bf16Pairs(const uint16_t* p, int64_t k) : packed(p), K(k) {}
  void pairs(int64_t b, int64_t p0, int64_t np, uint32_t* dst) const override {
    pair_block(packed + b * K * NB, K, p0, np, dst);
  }
  const uint16_t* bf16_blocks() const override { return packed; }
};
}  // namespace

void linear_bf16_dot(const c10::BFloat16* x, int64_t M, int64_t K, const uint16_t* packed,
                     int64_t N, const float* bias, float* yf, c10::BFloat16* yb) {
  linear_dot_gemm(x, M, K, N, Bf16Pairs(packed, K), bias, yf, yb);
}

void linear_bf16_dot_block(const c10::BFloat16* x, int64_t rows, int64_t K,
                           const uint16_t* wblock, float* y, int64_t ldy, int64_t ncols) {
#if defined(__AMX_BF16__)
  // The tiles sum in the same order for one block as for the whole GEMM.
  return amx_dot_gemm(x, rows, K, ncols, Bf16Pairs(wblock, K), nullptr, y, nullptr, ldy);
#endif
  // One block, all of K at once: the same sums in the same order as linear_bf16_dot's
  // chunks (a chunk's fp32 partial sums carry over exactly).
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint32_t> scratch(K2 * NB);
  int64_t ldx;
  const uint32_t* xp = pair_rows(x, rows, K, false, ldx);
  pair_block(wblock, K, 0, K2, scratch.data());
  dot_rows<false>(xp, ldx, scratch.data(), K2, K, Out{nullptr, 0, nullptr, y, nullptr, ldy},
                  rows, ncols);
}

#else  // no native bf16 dot products at this level: linear_bf16 never calls these

int64_t linear_bf16_dot_rows() { return 0; }

std::vector<int64_t> linear_bf16_dot_tuning(std::vector<int64_t>) { return {}; }

void linear_bf16_dot(const c10::BFloat16*, int64_t, int64_t, const uint16_t*, int64_t,
                     const float*, float*, c10::BFloat16*) {
  TORCH_CHECK(false, "linear_bf16_dot: not built at this level (", TOKENMILL_CPU_LEVEL_NAME, ")");
}

void linear_dot_gemm(const c10::BFloat16*, int64_t, int64_t, int64_t, const DotPairSource&,
                     const float*, float*, c10::BFloat16*) {
  TORCH_CHECK(false, "linear_dot_gemm: not built at this level (", TOKENMILL_CPU_LEVEL_NAME, ")");
}

void linear_bf16_dot_block(const c10::BFloat16*, int64_t, int64_t, const uint16_t*, float*,
                           int64_t, int64_t) {
  TORCH_CHECK(false, "linear_bf16_dot_block: not built at this level (",
              TOKENMILL_CPU_LEVEL_NAME, ")");
}

#endif
