// linear_dot_gemm on AMX tiles (TDPBF16PS), built at the amx level only (elsewhere
// amx_dot_gemm() is never called: cpu_linear_dot.cpp's vdpbf16ps path serves).
//
// Why: a TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32
// sums in one instruction, eight times the work per cycle of two vdpbf16ps; on a CPU
// with AMX, oneDNN's bf16 GEMM runs on it, and the packed path without it would be the
// slow copy of the weights.
//
// Layouts are the ones the vdpbf16ps path already makes: a DotPairSource writes a
// block's pair words [np, 32] (pair p of column c: bf16 (w[2p][c], w[2p + 1][c])), which
// are two B tiles as AMX wants them: a tile row is one pair p for 16 columns (64 bytes),
// rows 128 bytes apart, columns 0..15 in one tile and 16..31 in the other; x rows are
// pair words already (A tiles of 16 rows x 16 pairs). K is taken 16 pairs at a time, so both sides are zero padded
// to a multiple of 16 pairs (0 * 0 adds nothing; garbage there could be inf * 0 = NaN).
//
// The micro-kernel keeps 32 rows x 32 columns in the four C tiles (2 A + 2 B tiles
// loaded per 16 pairs). Long K goes in chunks of kc pairs (a multiple of 16) whose
// fp32 partial sums wait in a per-thread tile; every output value is summed over the
// same 16-pair groups in the same order whatever the rows, threads or chunking, so
// linear_bf16_dot_block (one block, the greedy head's recompute) is bit-identical to
// the whole GEMM.
#include "ops.h"
#include <ATen/Parallel.h>

#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t NB = 32;       // columns per packed block (cpu_linear.cpp)
constexpr int64_t KT = 16;       // pairs per tile step (64 bytes of a tile row)
constexpr int64_t MT = 16;       // rows per tile
constexpr int64_t MR = 2 * MT;   // rows per micro-kernel
constexpr int64_t MAX_GROUP = 16;
// Cache blocking: a column-block group's pair scratch (L2); pairs per K chunk when K
// has more than KC pairs (a micro-kernel's x rows, 32 x KC pairs, fit L1).
constexpr int64_t W_GROUP_BYTES = 512 << 10;
constexpr int64_t KC = 256;

// A per-thread buffer of at least n values, 64-byte aligned (tmamx::Aligned64).
template <typename T, int SLOT>
T* thread_buffer(int64_t n) {
  thread_local std::vector<T, tmamx::Aligned64<T>> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Where results go (as cpu_linear_dot.cpp's Out): fp32 yf or bf16 yb, row stride ldy,
// plus bias (or null).
struct Out {
  const float* bias;
  float* yf;
  c10::BFloat16* yb;
  int64_t ldy;
};

// rows x ncols fp32 sums c (row stride 32) + bias -> y.
inline void store_rows(const float* c, int64_t rows, int64_t ncols, const Out& out, int64_t m0,
                       int64_t n0) {
  for (int h = 0; h < 2; ++h) {
    const int n = static_cast<int>(std::clamp<int64_t>(ncols - 16 * h, 0, 16));
    if (n == 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 b = out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + n0 + 16 * h)
                                         : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const tmvec::Vec v(_mm512_add_ps(_mm512_loadu_ps(c + r * NB + 16 * h), b));
      const int64_t at = (m0 + r) * out.ldy + n0 + 16 * h;
      if (out.yf != nullptr) {
        _mm512_mask_storeu_ps(out.yf + at, mask, v.v);
      } else {  // c10's rounding (nearest even), as linear_bf16's other paths store
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v.round_bf16().v), 16);
        _mm256_mask_storeu_epi16(out.yb + at, mask, _mm512_cvtepi32_epi16(bits));
      }
    }
  }
}

// One micro-kernel: TWO (1 or 2) A tiles of 16 rows from x (row stride ldx words) over
// np pairs (a multiple of 16) against one block's pair scratch w ([np, 32] words).
// Sums start at zero (first chunk) or from `part` (fp32, row stride ldp); they end in
// `part` (not the last chunk) or in `c` ([32, 32] fp32).
template <int TWO>
inline void tile_kernel(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t np,
                        float* part, int64_t ldp, bool first, bool last, float* c) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TWO == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, part, ldp * 4);
    _tile_loadd(1, part + 16, ldp * 4);
    if constexpr (TWO == 2) {
      _tile_loadd(2, part + MT * ldp, ldp * 4);
      _tile_loadd(3, part + MT * ldp + 16, ldp * 4);
    }
  }
  for (int64_t p = 0; p < np; p += KT) {
    _tile_loadd(6, w + p * NB, NB * 4);
    _tile_loadd(7, w + p * NB + 16, NB * 4);
    _tile_loadd(4, x + p, ldx * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO == 2) {
      _tile_loadd(5, x + MT * ldx + p, ldx * 4);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* dst = last ? c : part;
  const int64_t ld = last ? NB : ldp;
  _tile_stored(0, dst, ld * 4);
  _tile_stored(1, dst + 16, ld * 4);
  if constexpr (TWO == 2) {
    _tile_stored(2, dst + MT * ld, ld * 4);
    _tile_stored(3, dst + MT * ld + 16, ld * 4);
  }
}

}  // namespace

bool amx_dot_ready() { return tmamx::request_tiles(); }

void amx_dot_gemm(const c10::BFloat16* x, int64_t M, int64_t K, int64_t N,
                  const DotPairSource& w, const float* bias, float* yf, c10::BFloat16* yb,
                  int64_t ldy) {
  TORCH_CHECK(tmamx::request_tiles(), "linear_dot_gemm: the OS refused this process the AMX tiles");
  const int64_t K2 = (K + 1) / 2, nblocks = (N + NB - 1) / NB;
  const int64_t kc = K2 > KC ? KC : round_up(K2, KT), nchunks = (K2 + kc - 1) / kc;
  // x as pair words, zero padded to whole 16-pair steps and 16-row tiles; the row
  // stride off multiples of 2 KB (a tile load's 16 rows would share a few L1 sets).
  int64_t ldx = round_up(nchunks * kc, KT);
  if (ldx * 4 % 2048 == 0) ldx += KT;
  const int64_t Mp = round_up(M, MT);
  uint32_t* xp = thread_buffer<uint32_t, 0>(Mp * ldx);
  at::parallel_for(0, Mp, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* row = xp + m * ldx;
      std::memset(row, 0, ldx * 4);
      if (m < M) std::memcpy(row, x + m * K, K * sizeof(uint16_t));
    }
  });
  // Work items: a group of column blocks (their scratch made once, in L2) x a part of
  // the rows; every item reads all of its rows' x. Few rows: groups small enough for
  // two a thread. Many rows: the largest groups (x, megabytes at prefill sizes, is
  // streamed once per group), the rows split between the threads.
  const int64_t nthreads = at::get_num_threads();
  const int64_t row_units = (M + MR - 1) / MR;
  int64_t G = std::clamp<int64_t>(W_GROUP_BYTES / (kc * NB * 4), 1, MAX_GROUP);
  if (row_units < 4 * nthreads) G = std::max<int64_t>(1, std::min(G, nblocks / (2 * nthreads)));
  const int64_t ngroups = (nblocks + G - 1) / G;
  const int64_t parts = ngroups >= 2 * nthreads
                            ? 1 : std::min(row_units, (2 * nthreads + ngroups - 1) / ngroups);
  const int64_t part_rows = (row_units + parts - 1) / parts * MR;
  const Out out{bias, yf, yb, ldy};
  at::parallel_for(0, ngroups * parts, 1, [&](int64_t i0, int64_t i1) {
    tmamx::TileScope tiles;
    uint32_t* scratch = thread_buffer<uint32_t, 1>(G * kc * NB);
    const int64_t ldp = G * NB;
    float* part = nchunks > 1 ? thread_buffer<float, 2>(std::min(round_up(M, MR), part_rows) * ldp)
                              : nullptr;
    alignas(64) float c[MR * NB];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / parts, pi = item % parts;
      const int64_t r0 = pi * part_rows, r1 = std::min(M, r0 + part_rows);
      const int64_t b0 = g * G, b1 = std::min(nblocks, b0 + G);
      if (r0 >= r1) continue;
      for (int64_t ci = 0; ci < nchunks; ++ci) {
        const int64_t p0 = ci * kc, np = std::min(kc, K2 - p0), npad = round_up(np, KT);
        const bool first = ci == 0, last = ci + 1 == nchunks;
        for (int64_t b = b0; b < b1; ++b) {
          uint32_t* s = scratch + (b - b0) * kc * NB;
          w.pairs(b, p0, np, s);
          std::memset(s + np * NB, 0, (npad - np) * NB * 4);
        }
        // A unit's 32 rows of x (32 x kc pairs: 32 KB) stay in L1 across the group's
        // blocks, whose scratch streams from L2; y is written a group's columns a row.
        for (int64_t m = r0; m < r1; m += MR) {
          const int64_t rows = std::min(MR, r1 - m);
          for (int64_t b = b0; b < b1; ++b) {
            const uint32_t* s = scratch + (b - b0) * kc * NB;
            const int64_t n0 = b * NB, ncols = std::min(NB, N - n0);
            float* pt = part ? part + (m - r0) * ldp + (b - b0) * NB : nullptr;
            if (rows > MT)
              tile_kernel<2>(xp + m * ldx + p0, ldx, s, npad, pt, ldp, first, last, c);
            else
              tile_kernel<1>(xp + m * ldx + p0, ldx, s, npad, pt, ldp, first, last, c);
            if (last) store_rows(c, rows, ncols, out, m, n0);
          }
        }
      }
    }
  });
}

#else  // no AMX at this level

bool amx_dot_ready() { return false; }

void amx_dot_gemm(const c10::BFloat16*, int64_t, int64_t, int64_t, const DotPairSource&,
                  const float*, float*, c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "amx_dot_gemm: not built at this level (", TOKENMILL_CPU_LEVEL_NAME, ")");
}

#endif
