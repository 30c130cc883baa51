// Greedy tokens straight from the lm_head, screening the vocabulary in int8.
//
// Why: a batch-1 decode step is bound by streaming weights from memory, and the
// lm_head is about 40% of them. A greedy row needs only the argmax of its
// logits, so it reads an int8 copy of the lm_head (half the bytes) to get
// approximate logits with a rigorous error bound, and recomputes exactly, with
// linear_bf16's own code, only the 32-column blocks that can hold the maximum.
// The token is the one argmax over linear_bf16's logits picks (the lowest index
// among equal logits, the first NaN if any), bit for bit. An fp32 lm_head (packed
// for linear_f32, a quarter of its bytes in int8) is screened the same way and
// recomputed with linear_f32's code.
//
// The bound. The activations are quantised per row to int16 (x ~ s_x xq, |xq| <=
// 16383) and the int8 x int16 products summed exactly in int32, so the
// approximation is s_n s_x sum_k q[n, k] xq[k]. Per column n, pack_int8_screen
// (tokenmill/models/layers/greedy_head.py) stores the scale s[n], l1w[n] =
// sum_k |w[n, k]| and coef[n], which covers the weights' quantisation error
// max_k |s q - w| and the fp32 rounding of this and of linear_bf16's dot
// products, with slack. Then, with l1 = ||x||_1 + K s_x (>= ||x~||_1),
//     |approx[m, n] - exact[m, n]| <= l1 * coef[n] + 0.5001 * s_x * l1w[n]
// where exact is linear_bf16's fp32 result. L = max_n (approx - bound) is a lower
// bound on the largest exact logit. Rounding to bf16 is monotone and moves a
// value by at most 2^-8 of it, so a column whose bf16 logit ties the maximum's
// has an exact logit above L - |L| 2^-6: a column whose upper bound is below
// that cannot be the argmax.
//
// Every capability level computes the same approximation bit for bit: the int32
// sums are exact whatever the instruction (AVX-512 VNNI / madd, AVX2 madd, NEON
// widening multiply-accumulate, SSE2 madd, plain C++), each int32 chunk is
// converted to fp32 with round-to-nearest and the chunks are added in k order.
// Only the screen's inner loop is per ISA; the bounds and the selection are
// plain C++, written once.
#include "vec.h"  // the level's ISA macros (TM_VEC_*) and intrinsics headers

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t QB = 64;     // int8 columns per block: 64 columns x 2 k per 128 bytes
constexpr int64_t NB = 32;     // linear_bf16's packed column block
constexpr int64_t PCH = 512;   // k pairs per int32 sum: 1024 * 127 * 16383 < 2^31
constexpr int32_t XQ_MAX = 16383;

// Fully unrolled, so the accumulator arrays live in registers: GCC leaves an
// 8-iteration loop (the write-back of 8 accumulators) rolled and the whole array
// then goes to the stack, every k pair.
#define TM_UNROLL _Pragma("GCC unroll 16")

// One ISA's int8 x int16 dot products. A block line (one k pair) is 128 bytes:
// column j's (q[2p], q[2p+1]) at bytes 2j, 2j+1. Acc holds the int32 sums of I
// consecutive columns; load() reads those columns' 2I bytes of a line, bcast() an
// int16 pair (xq[2p], xq[2p+1]) packed in a dword, dot() adds the pair products.
// kAccRegs: registers the accumulators may take (half the register file: the
// rest holds the weights, the broadcasts and temporaries); kRegsPerAcc: vector
// registers per Acc.
#if defined(TM_VEC_AVX512) && defined(__AVX512BW__)
#define TM_SCREEN_ISA "avx512"
// 32 registers: 4 rows x 64 columns (16 accumulators) per pass.
struct Screen {
  static constexpr int I = 16, kAccRegs = 16, kRegsPerAcc = 1, kMaxRows = 4;
  using Acc = __m512i;
  using Wt = __m512i;
  using Xb = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Wt load(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Xb bcast(uint32_t pair) { return _mm512_set1_epi32(static_cast<int>(pair)); }
  static Acc dot(Acc acc, Wt w, Xb x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
  }
  static void add_to(float* out, Acc acc) {
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_cvtepi32_ps(acc)));
  }
};
#elif defined(__AVX2__) && !defined(TM_VEC_GENERIC)
#define TM_SCREEN_ISA "avx2"
// 16 registers: rows in pairs over 32 columns (8 accumulators), a lone row over
// all 64 (measured: 4 rows over 16 columns spill and are slower).
struct Screen {
  static constexpr int I = 8, kAccRegs = 8, kRegsPerAcc = 1, kMaxRows = 2;
  using Acc = __m256i;
  using Wt = __m256i;
  using Xb = __m256i;
  static Acc zero() { return _mm256_setzero_si256(); }
  static Wt load(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Xb bcast(uint32_t pair) { return _mm256_set1_epi32(static_cast<int>(pair)); }
  static Acc dot(Acc acc, Wt w, Xb x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
  static void add_to(float* out, Acc acc) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), _mm256_cvtepi32_ps(acc)));
  }
};
#elif defined(TM_VEC_NEON)
#define TM_SCREEN_ISA "neon"
// No pairwise int16 dot product: ld2 splits a line's bytes into the even k and the
// odd k of 8 columns, widened to int16, and each is multiplied by its lane of the
// broadcast pair into int32 (smlal / smlal2), exact. 32 registers: 4 rows x 16
// columns or a lone row x 64 (16 registers of accumulators).
struct Screen {
  static constexpr int I = 8, kAccRegs = 16, kRegsPerAcc = 2, kMaxRows = 4;
  using Acc = int32x4x2_t;
  struct Wt {
    int16x8_t even, odd;
  };
  using Xb = int16x4_t;  // (xq[2p], xq[2p+1], xq[2p], xq[2p+1])
  static Acc zero() { return {{vdupq_n_s32(0), vdupq_n_s32(0)}}; }
  static Wt load(const int8_t* p) {
    const int8x8x2_t v = vld2_s8(p);
    return {vmovl_s8(v.val[0]), vmovl_s8(v.val[1])};
  }
  static Xb bcast(uint32_t pair) { return vreinterpret_s16_u32(vdup_n_u32(pair)); }
  static Acc dot(Acc acc, Wt w, Xb x) {
    int32x4_t lo = vmlal_lane_s16(acc.val[0], vget_low_s16(w.even), x, 0);
    lo = vmlal_lane_s16(lo, vget_low_s16(w.odd), x, 1);
    int32x4_t hi = vmlal_high_lane_s16(acc.val[1], w.even, x, 0);
    hi = vmlal_high_lane_s16(hi, w.odd, x, 1);
    return {{lo, hi}};
  }
  static void add_to(float* out, Acc acc) {
    vst1q_f32(out, vaddq_f32(vld1q_f32(out), vcvtq_f32_s32(acc.val[0])));
    vst1q_f32(out + 4, vaddq_f32(vld1q_f32(out + 4), vcvtq_f32_s32(acc.val[1])));
  }
};
#elif defined(TM_VEC_SSE2)
#define TM_SCREEN_ISA "sse2"
// SSE2 has pmaddwd but no pmovsx: a byte unpacked against itself then shifted
// right arithmetically by 8 is its sign extension. 16 registers: rows in pairs
// over 16 columns, a lone row over 32.
struct Screen {
  static constexpr int I = 4, kAccRegs = 8, kRegsPerAcc = 1, kMaxRows = 2;
  using Acc = __m128i;
  using Wt = __m128i;
  using Xb = __m128i;
  static Acc zero() { return _mm_setzero_si128(); }
  static Wt load(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm_srai_epi16(_mm_unpacklo_epi8(b, b), 8);
  }
  static Xb bcast(uint32_t pair) { return _mm_set1_epi32(static_cast<int>(pair)); }
  static Acc dot(Acc acc, Wt w, Xb x) { return _mm_add_epi32(acc, _mm_madd_epi16(w, x)); }
  static void add_to(float* out, Acc acc) {
    _mm_storeu_ps(out, _mm_add_ps(_mm_loadu_ps(out), _mm_cvtepi32_ps(acc)));
  }
};
#else
#define TM_SCREEN_ISA "generic"
// Plain C++: exact, not fast (the bindings report has_greedy_lm_head = False).
struct Screen {
  static constexpr int I = 4, kAccRegs = 16, kRegsPerAcc = 1, kMaxRows = 1;
  struct Acc {
    int32_t v[I];
  };
  struct Wt {
    int16_t v[2 * I];
  };
  struct Xb {
    int16_t lo, hi;
  };
  static Acc zero() { return Acc{}; }
  static Wt load(const int8_t* p) {
    Wt w;
    for (int i = 0; i < 2 * I; ++i) w.v[i] = p[i];
    return w;
  }
  static Xb bcast(uint32_t pair) {
    return {static_cast<int16_t>(pair & 0xffffu), static_cast<int16_t>(pair >> 16)};
  }
  static Acc dot(Acc acc, Wt w, Xb x) {
    for (int i = 0; i < I; ++i) acc.v[i] += w.v[2 * i] * x.lo + w.v[2 * i + 1] * x.hi;
    return acc;
  }
  static void add_to(float* out, Acc acc) {
    for (int i = 0; i < I; ++i) out[i] += static_cast<float>(acc.v[i]);
  }
};
#endif

// Accumulators (Acc) per row in a call of R rows: as many as the register budget
// allows, a power of two dividing the QB / I of a line.
constexpr int cols_per_pass(int R) {
  int cv = static_cast<int>(QB) / Screen::I;
  while (cv > 1 && R * cv * Screen::kRegsPerAcc > Screen::kAccRegs) cv /= 2;
  return cv;
}

// Approximate dot products of R rows with columns [c0 I, (c0 + CV) I) of one int8
// block [KP, 64, 2], added to out (R rows of QB floats): exact int32 sums per chunk
// of PCH pairs, each converted to fp32 and added in k order. xp: R rows of KP
// int16 pairs, ldx pairs apart.
template <int R, int CV>
inline void screen_cols(const uint32_t* xp, int64_t ldx, const int8_t* qb, int64_t KP, int c0,
                        float* out) {
  constexpr int64_t bytes = 2 * CV * Screen::I;  // of each 128-byte line this pass reads
  for (int64_t p0 = 0; p0 < KP; p0 += PCH) {
    const int64_t p1 = std::min(KP, p0 + PCH);
    Screen::Acc acc[R][CV];
    TM_UNROLL
    for (int r = 0; r < R; ++r)
      TM_UNROLL
      for (int c = 0; c < CV; ++c) acc[r][c] = Screen::zero();
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* line = qb + p * 2 * QB + 2 * c0 * Screen::I;
      // Bound by memory at few rows: keep lines ~8 KB ahead in flight.
      tmvec::prefetch(line + 64 * 2 * QB);
      if constexpr (bytes > 64) tmvec::prefetch(line + 64 * 2 * QB + 64);
      Screen::Xb xv[R];
      TM_UNROLL
      for (int r = 0; r < R; ++r) xv[r] = Screen::bcast(xp[r * ldx + p]);
      // Each weight vector used by every row as soon as it is loaded: one live at a
      // time (GCC keeps the source's order, and 16 registers are few).
      TM_UNROLL
      for (int c = 0; c < CV; ++c) {
        const Screen::Wt w = Screen::load(line + 2 * Screen::I * c);
        TM_UNROLL
        for (int r = 0; r < R; ++r) acc[r][c] = Screen::dot(acc[r][c], w, xv[r]);
      }
    }
    TM_UNROLL
    for (int r = 0; r < R; ++r)
      TM_UNROLL
      for (int c = 0; c < CV; ++c)
        Screen::add_to(out + r * QB + (c0 + c) * Screen::I, acc[r][c]);
  }
}

template <int R>
inline void screen_group(const uint32_t* xp, int64_t KP, const int8_t* qb, float* out) {
  constexpr int CV = cols_per_pass(R);
  for (int c0 = 0; c0 < QB / Screen::I; c0 += CV) screen_cols<R, CV>(xp, KP, qb, KP, c0, out);
}

// Rows below R: the call of exactly that many rows.
template <int R>
inline void screen_tail(const uint32_t* xp, int64_t KP, const int8_t* qb, int64_t rows,
                        float* out) {
  if constexpr (R > 1) {
    if (rows == R - 1) return screen_group<R - 1>(xp, KP, qb, out);
    return screen_tail<R - 1>(xp, KP, qb, rows, out);
  }
}

// All rows against one int8 block: out [rows, QB] = the approximate dot products.
inline void screen_rows(const uint32_t* xp, int64_t KP, const int8_t* qb, int64_t rows,
                        float* out) {
  std::fill(out, out + rows * QB, 0.f);
  constexpr int R = Screen::kMaxRows;
  int64_t m = 0;
  for (; m + R <= rows; m += R) screen_group<R>(xp + m * KP, KP, qb, out + m * QB);
  if (m < rows) screen_tail<R>(xp + m * KP, KP, qb, rows - m, out + m * QB);
}

}  // namespace

#if !defined(TM_GREEDY_SCREEN_ONLY)  // tests/kernels/greedy_screen_check.cpp: the screen alone
#include <ATen/Parallel.h>

#include "ops.h"

namespace {

// torch.argmax's order: the first NaN wins, else the first of the largest values.
inline bool better(float v, float best, bool have) {
  if (!have) return true;
  if (std::isnan(best)) return false;
  return std::isnan(v) || v > best;
}

// Largest of v[0, n) (n a multiple of 8) by 8 partial maxima: lanes the compiler
// vectorises. `a > b ? a : b` keeps b when a is NaN.
inline double max8(const double* v, int64_t n, double init) {
  double part[8];
  for (int l = 0; l < 8; ++l) part[l] = init;
  for (int64_t j = 0; j < n; j += 8)
    for (int l = 0; l < 8; ++l) part[l] = v[j + l] > part[l] ? v[j + l] : part[l];
  double r = part[0];
  for (int l = 1; l < 8; ++l) r = part[l] > r ? part[l] : r;
  return r;
}

// One row's bounds over columns [0, ncols) of a 64-column block (ncols >= 1): raises
// *lower_max to the largest lower bound (a NaN one is skipped) and stores the
// largest upper bound of each 32-column half present (NaN as +inf: that block
// stays a candidate). Plain loops of fixed length (the padded columns' inputs
// exist, zero): the compiler vectorises them.
inline void bound_block(const float* approx, const float* scale, const float* coef,
                        const float* l1w, double sx, double l1, int64_t ncols, double* lower_max,
                        double* upper_max) {
  const double hx = 0.5001 * sx;
  constexpr double slack = 1.0 + 0x1p-30;  // room for this double arithmetic's own rounding
  constexpr double inf = std::numeric_limits<double>::infinity();
  double up[QB], lo[QB];
  for (int64_t j = 0; j < QB; ++j) {
    const double a = static_cast<double>(approx[j]) * (sx * static_cast<double>(scale[j]));
    const double err =
        (l1 * static_cast<double>(coef[j]) + hx * static_cast<double>(l1w[j])) * slack;
    const double u = a + err;
    up[j] = u == u ? u : inf;
    lo[j] = a - err;
  }
  for (int64_t j = ncols; j < QB; ++j) up[j] = lo[j] = -inf;  // past the vocabulary
  *lower_max = max8(lo, QB, *lower_max);
  upper_max[0] = max8(up, NB, -inf);
  if (ncols > NB) upper_max[1] = max8(up + NB, NB, -inf);
}

}  // namespace

// x [M, K] fp32 or bf16 (M <= 128: one linear_bf16 cache block), packed from
// pack_bf16_weight (or from pack_f32_weight, x fp32: linear_f32's logits),
// q [ceil(N/64), ceil(K/2), 64, 2] int8, scale / coef / l1w
// [ceil(N/64) * 64] fp32, N the vocabulary -> (token ids [M] int64, how many
// 32-column blocks were recomputed exactly).
std::tuple<torch::Tensor, int64_t> greedy_lm_head(torch::Tensor x, torch::Tensor packed,
                                                  torch::Tensor q, torch::Tensor scale,
                                                  torch::Tensor coef, torch::Tensor l1w,
                                                  int64_t N) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "greedy_lm_head: x must be [M, K] fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), KP = (K + 1) / 2;
  TORCH_CHECK(M >= 1 && M <= 128, "greedy_lm_head: 1 to 128 rows");
  const bool f32_weights = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == NB &&
                  packed.is_contiguous() &&
                  (packed.scalar_type() == at::kBFloat16 || f32_weights),
              "greedy_lm_head: weights must come from pack_bf16_weight or pack_f32_weight");
  TORCH_CHECK(!f32_weights || x.scalar_type() == at::kFloat,
              "greedy_lm_head: fp32 weights (pack_f32_weight) take fp32 x");
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NB, "greedy_lm_head: bad column count");
  const int64_t nq = (N + QB - 1) / QB;
  TORCH_CHECK(q.dim() == 4 && q.size(0) == nq && q.size(1) == KP && q.size(2) == QB &&
                  q.size(3) == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "greedy_lm_head: q must be [ceil(N/64), ceil(K/2), 64, 2] int8");
  for (const auto* t : {&scale, &coef, &l1w})
    TORCH_CHECK(t->numel() == nq * QB && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "greedy_lm_head: scale, coef and l1w must be [ceil(N/64) * 64] fp32");
  const bool round_bf16 = x.scalar_type() == at::kBFloat16;
  std::vector<float> xf(M * K);
  {
    torch::Tensor xc = x.contiguous();
    if (round_bf16) {
      const auto* src = xc.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(src[i]);
    } else {
      std::copy(xc.data_ptr<float>(), xc.data_ptr<float>() + M * K, xf.data());
    }
  }
  auto ids = torch::empty({M}, torch::dtype(torch::kLong));
  // Per row: ||x||_1 (in double: its own rounding is far inside the slack), the
  // int16 scale s_x and the pairs (xq[2p], xq[2p + 1]) the dot products read.
  std::vector<double> l1(M), sx(M);
  std::vector<uint32_t> xpairs(M * KP, 0);
  bool finite = true;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xf.data() + m * K;
    double sum = 0.0;
    float maxabs = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      sum += std::fabs(static_cast<double>(xr[k]));
      maxabs = std::max(maxabs, std::fabs(xr[k]));
    }
    finite = finite && std::isfinite(sum);
    const double s = static_cast<double>(maxabs / XQ_MAX);
    // Little-endian (x86-64, aarch64): the dword's low half is xq[2p].
    auto* pairs = reinterpret_cast<uint16_t*>(xpairs.data() + m * KP);
    for (int64_t k = 0; k < K && s > 0 && std::isfinite(s); ++k) {
      const double v = std::nearbyint(static_cast<double>(xr[k]) / s);
      pairs[k] = static_cast<uint16_t>(static_cast<int16_t>(std::clamp(v, -16383.0, 16383.0)));
    }
    sx[m] = s;
    l1[m] = sum + static_cast<double>(K) * s;
  }
  const int64_t nb32 = (N + NB - 1) / NB;
  std::vector<uint8_t> candidate(nb32, finite ? 0 : 1);
  if (finite) {
    // Pass 1: per row, the largest upper bound of each 32-column block and each
    // thread's largest lower bound.
    std::vector<double> upper_max(M * nb32);
    const int nthreads = at::get_num_threads();
    std::vector<double> lower_max(nthreads * M, -std::numeric_limits<double>::infinity());
    const auto* qp = q.data_ptr<int8_t>();
    const float* sp = scale.data_ptr<float>();
    const float* cp = coef.data_ptr<float>();
    const float* wp1 = l1w.data_ptr<float>();
    at::parallel_for(0, nq, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> approx(M * QB);
      double* lmax = lower_max.data() + at::get_thread_num() * M;
      for (int64_t b = b0; b < b1; ++b) {
        screen_rows(xpairs.data(), KP, qp + b * KP * 2 * QB, M, approx.data());
        const int64_t n0 = b * QB, ncols = std::min(QB, N - n0);
        for (int64_t m = 0; m < M; ++m)
          bound_block(approx.data() + m * QB, sp + n0, cp + n0, wp1 + n0, sx[m], l1[m], ncols,
                      lmax + m, upper_max.data() + m * nb32 + 2 * b);
      }
    });
    // Pass 2: the 32-column blocks whose largest upper bound reaches the threshold.
    for (int64_t m = 0; m < M; ++m) {
      double L = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < nthreads; ++t) L = std::max(L, lower_max[t * M + m]);
      const double threshold = std::isfinite(L) ? L - std::fabs(L) * 0x1p-6 - 1e-37
                                                : -std::numeric_limits<double>::infinity();
      const double* um = upper_max.data() + m * nb32;
      for (int64_t b = 0; b < nb32; ++b) candidate[b] |= static_cast<uint8_t>(um[b] >= threshold);
    }
  }
  std::vector<int64_t> blocks;
  for (int64_t b = 0; b < nb32; ++b)
    if (candidate[b]) blocks.push_back(b);
  // Pass 3: those blocks exactly, for all M rows together (linear_bf16's and
  // linear_f32's arithmetic for a block depends on its row count), then argmax in
  // column order.
  const int64_t nc = static_cast<int64_t>(blocks.size());
  std::vector<float> exact(nc * M * NB);
  at::parallel_for(0, nc, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = blocks[i], ncols = std::min(NB, N - b * NB);
      float* y = exact.data() + i * M * NB;
      if (f32_weights)
        linear_f32_block(xf.data(), K, packed.data_ptr<float>() + b * K * NB, y, NB, M, ncols);
      else
        linear_bf16_block(xf.data(), K, reinterpret_cast<const uint16_t*>(packed.data_ptr()) +
                                            b * K * NB, y, NB, M, ncols, round_bf16);
    }
  });
  auto* out = ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    float best = 0.f;
    int64_t best_n = -1;
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = blocks[i], ncols = std::min(NB, N - b * NB);
      const float* row = exact.data() + (i * M + m) * NB;
      for (int64_t j = 0; j < ncols; ++j) {
        // The logits tensor is bf16 when x is: compare the rounded values.
        const float v = round_bf16 ? static_cast<float>(c10::BFloat16(row[j])) : row[j];
        if (better(v, best, best_n >= 0)) {
          best = v;
          best_n = b * NB + j;
        }
      }
    }
    out[m] = best_n;
  }
  return {ids, nc};
}
#endif  // !TM_GREEDY_SCREEN_ONLY
