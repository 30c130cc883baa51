// y = x @ W'^T + b for integer-quantized weights (W8A16 / W4A16: GPTQ, AWQ,
// compressed-tensors, int8 made at load) and float8_e4m3fn ones (FP8 checkpoints,
// fp8 made at load), fp32 math; at the avx2, avx512 and avx512_vnni levels 4- / 8-bit
// codes may instead be packed in the quad layout (below) and multiplied as integers on
// 15-bit activations.
//
// W' is the canonical form of models/layers/linear_methods/quantized_weight.py:
// W'[n, k] = (code[n, k] - zero[n, g]) * scale[n, g], g = k / group_size, codes
// unsigned 4- or 8-bit; for the e4m3 kind (bits = kQuantE4m3, ops.h) W'[n, k] =
// e4m3(code[n, k]) * scale[n, g], no zero point (fp8.py's block scales expanded to
// one per column and group: a [bn, bk] block is bn columns' scales for group bk).
// Why a kernel of its own: a decode step is bound by the bytes of weights it reads,
// and these weights are 1 or 0.5 byte each against bf16's 2; widening the codes in
// registers keeps that advantage (no dequantized copy of the matrix is made or kept).
//
// Packed layout, made once at load (pack_quant_weight), per block of 32 output
// columns (zero padded), the same at every capability level (the quad layout aside):
// - codes: 8-bit and e4m3 [N/32, K, 32] bytes, columns in order; 4-bit [N/32, K, 16] bytes,
//   byte i = column i in the low nibble, column 16 + i in the high one (the pair
//   interleave of cpu_linear.cpp's bf16 layout): W bytes widened to W dwords give
//   W columns (& 0xf) and the W columns 16 further on (>> 4), vec_int.h's load_u4_pairs.
//   A k line is one load of 32 or 16 bytes for the 32 columns, streamed in order.
// - scales [N/32, G, 32] and zeros [N/32, G, 32] uint8: a group's 32 values are one
//   line, read once per group (e4m3: no zeros, an empty tensor). Scales are stored in
//   fp16 when every one of them is exactly an fp16 (GPTQ / AWQ checkpoints store fp16
//   scales), else in fp32, so the resident bytes stay within 1.1x of the checkpoint's
//   (int4, group 32: 0.59 vs 0.58 B/weight; group 128: 0.52 vs 0.52; e4m3 [128, 128]
//   blocks, fp32 scales per column: 1.03 vs 1.00; per-channel: 1.00 vs 1.00).
//
// Math: per group and column, sum_k x[k] * code[k] is accumulated in fp32 and the
// group is closed with scale * (sum - zero * sum_k x[k]) (the row's per-group sums
// of x are computed once per call): one FMA per widened weight vector, no
// subtraction in the stream, where subtracting the zero per element would add an op
// per weight and a register per column vector. The e4m3 kind has no zero: its groups
// close with scale * sum (no sums of x made). The codes and zero points are exact
// fp32 integers, e4m3 codes exact fp32 values (x 2^-8, the scales x 2^8); the result is
// W'x up to fp32 rounding (tests: within 1e-5 of |x| |W'|^T of the float64 product,
// as the reference is). Inputs of DEQUANT_MIN_ROWS rows and more dequantize the block
// once into fp32 [K, 32] (exactly the reference's W') and take linear_f32_block:
// there the widening would be repeated per row pair.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "vec_fp8.h"
#include "vec_int.h"

namespace {

using tmvec::Vec;

// GCC outlined codes_at<4> from the row-blocked loop (a call, spills and a vzeroupper
// per k: 3x slower); the per-k helpers must be inlined into their loops.
#define TM_INLINE inline __attribute__((always_inline))

constexpr int64_t NB = 32;      // output columns per packed block
constexpr int C = NB / Vec::W;  // vectors per block row
constexpr int H = C / 2;        // 4-bit: byte vectors per k (each gives a lo and a hi)
// Rows per micro-kernel call: R x C group sums, C weights and x's broadcast must fit
// the vector registers (AVX2: 2 rows; at 3 the sums spill and a row costs 40% more).
constexpr int MR = std::clamp((Vec::kRegs - C - 1) / C, 1, 12);
constexpr int64_t MC = 128;  // rows per linear_f32_block call on a dequantized block
// Rows from this many up dequantize the block once and take linear_f32_block (measured
// on the AVX2 EPYC, 4096 x 4096 int4 / int8 g128, one thread: ~0.56 ms a row either way
// at 8-32 rows; the dequantized block then spares the widening per pair of rows).
constexpr int64_t DEQUANT_MIN_ROWS = 16;

inline int lanes(int64_t ncols, int c) {
  return static_cast<int>(std::clamp<int64_t>(ncols - c * Vec::W, 0, Vec::W));
}

// BITS: the packed kind, 4, 8 or kQuantE4m3 (a byte a code, no zero point).
template <int BITS>
constexpr int64_t kLine = BITS == 4 ? NB / 2 : NB;  // code bytes per k of a block
template <int BITS>
constexpr bool kHasZeros = BITS != kQuantE4m3;
// e4m3 codes are widened to their value x 2^-8 (load_e4m3_over256: one multiply per
// weight fewer), the scales multiplied by 2^8 as they are read (once per group):
// both exact, so every product and sum is the reference's, scaled by a power of two.
template <int BITS, typename S>
TM_INLINE Vec load_scale(const S* p) {
  if constexpr (BITS == kQuantE4m3) return Vec::load(p) * Vec::set1(256.f);
  else return Vec::load(p);
}

// The block's 32 codes at k widened to fp32, vector c = columns c*W .. c*W+W-1.
template <int BITS>
TM_INLINE void codes_at(const uint8_t* w, int64_t k, Vec* out) {
  const uint8_t* p = w + k * kLine<BITS>;
  if constexpr (BITS == 8) {
    for (int c = 0; c < C; ++c) out[c] = tmvec::load_u8(p + c * Vec::W);
  } else if constexpr (BITS == kQuantE4m3) {
    for (int c = 0; c < C; ++c) out[c] = tmvec::load_e4m3_over256(p + c * Vec::W);
  } else {
    for (int j = 0; j < H; ++j) tmvec::load_u4_pairs(p + j * Vec::W, out[j], out[j + H]);
  }
}

// One packed column block. S: the scales' type (float or c10::Half).
template <typename S>
struct QBlock {
  const uint8_t* codes;   // [K, kLine]
  const S* scales;        // [G, 32]
  const uint8_t* zeros;   // [G, 32] (nullptr: the e4m3 kind)
  int64_t K, group, G;
};

// Keep the stream 8 KB ahead of a lone row (a few rows: still a weight stream).
template <int BITS>
TM_INLINE void prefetch_ahead(const uint8_t* w, int64_t k) {
  constexpr int64_t ahead = 8192 / kLine<BITS>;
  tmvec::prefetch(w + (k + ahead) * kLine<BITS>);
}

// Close group g of column vector c: out[r] += scale * (sums[r] - zero * xsum[r, g]),
// out[r] += scale * sums[r] for e4m3 (xs[xi]: the row's sum of x over the group, read
// only where there is a zero point: for e4m3 xs is empty).
template <int BITS, typename S>
TM_INLINE void close_group(const QBlock<S>& b, int64_t g, int c, Vec sums, const float* xs,
                           int64_t xi, float* out) {
  const Vec s = load_scale<BITS>(b.scales + g * NB + c * Vec::W);
  float* o = out + c * Vec::W;
  if constexpr (kHasZeros<BITS>) {
    const Vec z = tmvec::load_u8(b.zeros + g * NB + c * Vec::W);
    tmvec::fma(sums - z * Vec::set1(xs[xi]), s, Vec::load(o)).store(o);
  } else {
    tmvec::fma(sums, s, Vec::load(o)).store(o);
  }
}

// out [R, 32] (+ bias) -> y's ncols columns.
template <int R>
inline void store_rows(const float* out, const float* bias, float* y, int64_t ldy,
                       int64_t ncols) {
  for (int c = 0; c < C; ++c) {
    const int n = lanes(ncols, c);
    if (n == 0) continue;
    const Vec bv = bias != nullptr ? Vec::load_n(bias + c * Vec::W, n) : Vec::zero();
    for (int r = 0; r < R; ++r) {
      const Vec v = Vec::load(out + r * NB + c * Vec::W) + bv;
      float* yr = y + r * ldy + c * Vec::W;
      if (n == Vec::W) v.store(yr); else v.store_n(yr, n);
    }
  }
}

// R rows of x (stride ldx) against one block: each widened weight vector serves R rows.
template <int R, int BITS, typename S>
inline void micro(const float* x, int64_t ldx, const float* xs, int64_t ldxs,
                  const QBlock<S>& b, const float* bias, float* y, int64_t ldy,
                  int64_t ncols) {
  alignas(64) float out[R * NB] = {};
  for (int64_t g = 0; g < b.G; ++g) {
    const int64_t k1 = std::min(b.K, (g + 1) * b.group);
    Vec sums[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c] = Vec::zero();
    for (int64_t k = g * b.group; k < k1; ++k) {
      if ((k * kLine<BITS>) % 64 == 0) prefetch_ahead<BITS>(b.codes, k);  // once a line
      Vec w[C];
      codes_at<BITS>(b.codes, k, w);
      for (int r = 0; r < R; ++r) {
        const Vec xv = Vec::set1(x[r * ldx + k]);
        for (int c = 0; c < C; ++c) sums[r][c] = tmvec::fma(xv, w[c], sums[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        close_group<BITS>(b, g, c, sums[r][c], xs, r * ldxs + g, out + r * NB);
  }
  store_rows<R>(out, bias, y, ldy, ncols);
}

// One row: U independent sets of group sums (8 vectors in all) so the lone decode row
// is not serialised on FMA latency, and prefetches keeping the stream ahead.
template <int BITS, typename S>
inline void micro_row(const float* x, const float* xs, const QBlock<S>& b, const float* bias,
                      float* y, int64_t ncols) {
  constexpr int U = C >= 8 ? 1 : 8 / C;
  alignas(64) float out[NB] = {};
  for (int64_t g = 0; g < b.G; ++g) {
    int64_t k = g * b.group;
    const int64_t k1 = std::min(b.K, k + b.group);
    Vec part[U][C];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) part[u][c] = Vec::zero();
    for (; k + 4 <= k1; k += 4) {
      // 4 k lines: 128 bytes (8-bit, e4m3) or 64 (4-bit), one prefetch per 64-byte line
      prefetch_ahead<BITS>(b.codes, k);
      if constexpr (kLine<BITS> == NB) prefetch_ahead<BITS>(b.codes, k + 2);
      for (int i = 0; i < 4; ++i) {
        Vec w[C];
        codes_at<BITS>(b.codes, k + i, w);
        const Vec xv = Vec::set1(x[k + i]);
        for (int c = 0; c < C; ++c) part[i % U][c] = tmvec::fma(xv, w[c], part[i % U][c]);
      }
    }
    for (; k < k1; ++k) {
      Vec w[C];
      codes_at<BITS>(b.codes, k, w);
      const Vec xv = Vec::set1(x[k]);
      for (int c = 0; c < C; ++c) part[0][c] = tmvec::fma(xv, w[c], part[0][c]);
    }
    for (int c = 0; c < C; ++c) {
      Vec sum = part[0][c];
      for (int u = 1; u < U; ++u) sum = sum + part[u][c];
      close_group<BITS>(b, g, c, sum, xs, g, out);
    }
  }
  store_rows<1>(out, bias, y, NB, ncols);
}

template <int BITS, typename S, int R>
inline void rows_tail(const float* x, int64_t ldx, const float* xs, int64_t ldxs,
                      const QBlock<S>& b, const float* bias, float* y, int64_t ldy,
                      int64_t rows, int64_t ncols) {
  if constexpr (R > 1) {  // rows < R: the micro-kernel of exactly that many rows
    if (rows == R - 1) return micro<R - 1, BITS>(x, ldx, xs, ldxs, b, bias, y, ldy, ncols);
    return rows_tail<BITS, S, R - 1>(x, ldx, xs, ldxs, b, bias, y, ldy, rows, ncols);
  }
}

// W' of the block transposed: out[k * ld + n] for its first ncols columns n, fp32,
// (code - zero) * scale as the reference computes it (the difference is exact, the
// product one rounding); e4m3: value * scale, one rounding, as fp8.py's reference.
// Stores lanes of v at p: fp32 as they are, bf16 rounded as c10 rounds (RNE), so a bf16
// tile equals the fp32 one converted with .to(torch.bfloat16), bit for bit.
static inline void store_lanes(const Vec& v, float* p, int n) {
  if (n == Vec::W) v.store(p); else v.store_n(p, n);
}
static inline void store_lanes(const Vec& v, c10::BFloat16* p, int n) {
  if (n == Vec::W) return v.store(p);
  float tmp[Vec::W];
  v.store(tmp);
  for (int i = 0; i < n; ++i) p[i] = c10::BFloat16(tmp[i]);
}

template <int BITS, typename S, typename T>
void dequantize_block(const QBlock<S>& b, T* out, int64_t ld, int64_t ncols) {
  for (int64_t g = 0; g < b.G; ++g) {
    Vec s[C], z[C];
    for (int c = 0; c < C; ++c) {
      s[c] = load_scale<BITS>(b.scales + g * NB + c * Vec::W);
      if constexpr (kHasZeros<BITS>) z[c] = tmvec::load_u8(b.zeros + g * NB + c * Vec::W);
    }
    const int64_t k1 = std::min(b.K, (g + 1) * b.group);
    for (int64_t k = g * b.group; k < k1; ++k) {
      Vec w[C];
      codes_at<BITS>(b.codes, k, w);
      for (int c = 0; c < C; ++c) {
        const int n = lanes(ncols, c);
        Vec v;
        if constexpr (kHasZeros<BITS>) v = (w[c] - z[c]) * s[c]; else v = w[c] * s[c];
        if (n > 0) store_lanes(v, out + k * ld + c * Vec::W, n);
      }
    }
  }
}

// rows of x against a block dequantized to fp32 [K, 32] (+ bias), exactly.
inline void dequantized_rows(const float* x, const float* wblock, int64_t K, const float* bias,
                             float* y, int64_t ldy, int64_t rows, int64_t ncols) {
  for (int64_t m0 = 0; m0 < rows; m0 += MC) {
    const int64_t mr = std::min(MC, rows - m0);
    linear_f32_block(x + m0 * K, K, wblock, y + m0 * ldy, ldy, mr, ncols);
  }
  if (bias == nullptr) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < ncols; ++n) y[r * ldy + n] += bias[n];
}

// ---- The quad layout: integer dot products on 15-bit activations ----
//
// Why: at one row the widening kernels above spend three vector ops per 16 weights
// (widen, convert, FMA), and where the weights sit in the last-level cache (a small
// model) that, not memory, sets the speed. Integer dot products multiply the codes as
// they are against activations made integers: per row and block of up to kActBlock k
// (within a group), x is scaled so max |x| maps to 16383 and rounded (xq = rne(x *
// 16383 / amax)). Every level computes the same exact integer sums per column and
// activation block, sum_k (code - zero) * xq, made as sum_k code * xq - zero * sum_k xq
// (each below 2^30 in magnitude: 128 * 255 * 16383 < 2^29), and closes each with the
// same two fp32 operations (close_sum): out += float(sum) * (scale * x's scale), one
// conversion and one FMA, the outputs kept in registers across the groups. So the
// levels' results are bit-identical, and the zero point costs no fp32 operation of its
// own (symmetric or not):
// - avx512_vnni: `vpdpbusd` multiplies 4 unsigned bytes by 4 signed bytes and adds the
//   sum to an int32 lane; xq (15 bits with its sign) is split into two signed bytes,
//   xq = hi * 128 + lo with lo in [0, 127]: two `vpdpbusd` per 64 weights of a row, no
//   widening at all;
// - avx512 and avx2 (no VNNI): the code bytes are zero-extended to int16 (one
//   vpmovzxbw per 32 or 16 weights, shared by the rows) and `vpmaddwd` multiplies them
//   by xq as int16, adding k pairs into int32 lanes (at most 2 * 255 * 16383 each, no
//   saturation; `vpmaddubsw` would saturate on 8-bit codes): each column keeps two
//   partial sums (k 4q, 4q+1 and 4q+2, 4q+3), added when the activation block closes.
//   Per row and 32 weights two integer ops against the widening kernel's four.
// The only error is the rounding of x, at most amax / 32766 per element: below a bf16
// activation's own rounding unless an element is 128x smaller than its block's largest,
// which is why only bf16 models take this layout (quantized_cpu.py); fp32 models keep
// the exact widening kernels.
//
// Layout (pack_quant_weight(quad=true)), per block of 32 columns, K a multiple of 8:
// - 8-bit: [K/4, 128] bytes: line q holds, for each column c, its codes at k = 4q..4q+3
//   in bytes 4c..4c+3 (a 64-byte load is 16 columns' dwords, vpdpbusd's unsigned side);
// - 4-bit: [K/8, 128] bytes: line o, bytes 4c..4c+3 hold column c's codes at k = 8o + j
//   in the low nibble and 8o + 4 + j in the high one (masking gives the quad 8o..8o+3,
//   a shift and a mask the quad 8o+4..8o+7).
// Groups must be a multiple of 8 (or the whole K) so that no line spans two.
#if defined(TM_VEC_AVX512) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_QUANT_QUAD 1
#define TM_QUANT_QUAD_VNNI 1
#elif (defined(TM_VEC_AVX512) && defined(__AVX512BW__)) || defined(TM_VEC_AVX2)
#define TM_QUANT_QUAD 1
#define TM_QUANT_QUAD_MADD 1
#endif

constexpr int64_t kQuadLine = 128;  // bytes per line of a 32-column block
template <int BITS>
constexpr int64_t kQuadK = BITS == 4 ? 8 : 4;  // k per line
constexpr int64_t kActBlock = 128;  // k per activation scale (sums stay below 2^31)
constexpr float kActMax = 16383.f;  // xq in [-16383, 16383]: hi in [-128, 127]

// Activation blocks per group: blocks never straddle a group boundary.
inline int64_t act_blocks_per_group(int64_t group, int64_t K) {
  return (std::min(group, K) + kActBlock - 1) / kActBlock;
}

// Rows of x as 15-bit integers: split into two signed bytes per k, 4 k a dword (VNNI),
// or int16 per k (vpmaddwd). Views of the calling thread's scratch (quad_scratch): a
// decode step makes dozens of calls, none of which should allocate.
struct QuadX {
  const int32_t* hi = nullptr;    // [M, K/4] (VNNI)
  const int32_t* lo = nullptr;
  const int16_t* x16 = nullptr;   // [M, K] (vpmaddwd)
  const float* scale = nullptr;   // [M, G, bpg]: amax / 16383 per activation block
  const int32_t* xsum = nullptr;  // [M, G, bpg]: sum of xq over the block (zero points)
  int64_t K = 0, nq = 0, bpg = 0, G = 0;
  int64_t at(int64_t m, int64_t g, int64_t j) const { return (m * G + g) * bpg + j; }
};

struct QuadScratch {
  std::vector<int32_t> hi, lo, xsum;
  std::vector<int16_t> x16;
  std::vector<float> scale;
};
inline QuadScratch& quad_scratch() {
  thread_local QuadScratch s;
  return s;
}

#if defined(TM_QUANT_QUAD)
// One activation block's scale from its largest |x| and whether its row is finite: a
// NaN or infinite x makes every scale of its row NaN, so the row's outputs are NaN (as
// the fp32 product's would be: NaN, or inf against codes of both signs after the zero
// point), the other rows untouched. A block whose largest |x| is below kActMax /
// FLT_MAX (~4.8e-35: 1 / step would overflow to inf, and inf * 0 is NaN) counts as
// zero, as an all-zero block does: its products are below 1e-32, under the fp32
// rounding of any output that is not itself that small. -> (1 / step, step).
inline std::pair<float, float> act_scale(float amax, bool finite) {
  constexpr float kTiny = kActMax / std::numeric_limits<float>::max();
  const float inv = finite && amax > kTiny ? kActMax / amax : 0.f;
  const float scale = finite ? amax / kActMax : std::numeric_limits<float>::quiet_NaN();
  return {inv, scale};
}

// Sizes the calling thread's scratch for M rows; -> the view, pointers set.
QuadX quad_x_for(int64_t M, int64_t K, int64_t group, int64_t G) {
  QuadScratch& sc = quad_scratch();
  QuadX q;
  q.K = K;
  q.nq = K / 4;
  q.bpg = act_blocks_per_group(group, K);
  q.G = G;
  sc.scale.resize(M * G * q.bpg);  // (entries of blocks past a group's end: never read)
  sc.xsum.resize(M * G * q.bpg);
#if defined(TM_QUANT_QUAD_VNNI)
  sc.hi.resize(M * q.nq);
  sc.lo.resize(M * q.nq);
  q.hi = sc.hi.data();
  q.lo = sc.lo.data();
#else
  sc.x16.resize(M * K);
  q.x16 = sc.x16.data();
#endif
  q.scale = sc.scale.data();
  q.xsum = sc.xsum.data();
  return q;
}

#if defined(TM_VEC_AVX512)
// x [M, K] fp32 -> QuadX. K and the block bounds are multiples of 8.
QuadX quantize_x(const float* x, int64_t M, int64_t K, int64_t group, int64_t G) {
  const QuadX q = quad_x_for(M, K, group, G);
  // The scratch's pointers, taken once: read through the thread_local inside the loops,
  // each access was a __tls_get_addr call (this module's TLS model), and with it a
  // vzeroupper and the vectors spilled, per 16 values (one row, K 4096: 8.9 -> 7.8 us).
  QuadScratch& sc = quad_scratch();
  float* const scales = sc.scale.data();
  int32_t* const xsums = sc.xsum.data();
#if defined(TM_QUANT_QUAD_VNNI)
  auto* const hi_all = reinterpret_cast<int8_t*>(sc.hi.data());
  auto* const lo_all = reinterpret_cast<int8_t*>(sc.lo.data());
#else
  int16_t* const x16_all = sc.x16.data();
#endif
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m512 vbad = _mm512_setzero_ps();  // x * 0: NaN where x is inf / NaN
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mk = K - k >= 16 ? 0xffff : 0xff;  // K is a multiple of 8
      vbad = _mm512_add_ps(vbad, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + k),
                                               _mm512_setzero_ps()));
    }
    const bool finite = _mm512_reduce_add_ps(vbad) == 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t gk1 = std::min(K, (g + 1) * group);
      for (int64_t j = 0; j < q.bpg; ++j) {
        const int64_t k0 = g * group + j * kActBlock, k1 = std::min(gk1, k0 + kActBlock);
        if (k0 >= k1) break;
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 16) {
          const __mmask16 mk = k1 - k >= 16 ? 0xffff : 0xff;  // blocks are multiples of 8
          vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, xr + k)));
        }
        const auto [inv, scale] = act_scale(_mm512_reduce_max_ps(vmax), finite);
        const __m512 vinv = _mm512_set1_ps(inv);
        __m512i vsum = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 16) {
          const __mmask16 mk = k1 - k >= 16 ? 0xffff : 0xff;
          const __m512i xq = _mm512_cvtps_epi32(  // round to nearest even, as torch.round
              _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + k), vinv));
          vsum = _mm512_add_epi32(vsum, xq);  // (masked lanes: 0)
#if defined(TM_QUANT_QUAD_VNNI)
          int8_t* hi = hi_all + m * q.nq * 4;
          int8_t* lo = lo_all + m * q.nq * 4;
          _mm_mask_storeu_epi8(hi + k, mk, _mm512_cvtepi32_epi8(_mm512_srai_epi32(xq, 7)));
          _mm_mask_storeu_epi8(lo + k, mk, _mm512_cvtepi32_epi8(
              _mm512_and_si512(xq, _mm512_set1_epi32(127))));
#else
          _mm256_mask_storeu_epi16(x16_all + m * K + k, mk, _mm512_cvtepi32_epi16(xq));
#endif
        }
        scales[q.at(m, g, j)] = scale;
        xsums[q.at(m, g, j)] = _mm512_reduce_add_epi32(vsum);
      }
    }
  }
  return q;
}
#else  // AVX2: the same values, 8 k at a time (blocks are multiples of 8)
QuadX quantize_x(const float* x, int64_t M, int64_t K, int64_t group, int64_t G) {
  const QuadX q = quad_x_for(M, K, group, G);
  QuadScratch& sc = quad_scratch();  // (its pointers taken once: see above)
  float* const scales = sc.scale.data();
  int32_t* const xsums = sc.xsum.data();
  int16_t* const x16_all = sc.x16.data();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m256 vbad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8)
      vbad = _mm256_add_ps(vbad, _mm256_mul_ps(_mm256_loadu_ps(xr + k), _mm256_setzero_ps()));
    const bool finite = tmvec::reduce_add(Vec(vbad)) == 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t gk1 = std::min(K, (g + 1) * group);
      for (int64_t j = 0; j < q.bpg; ++j) {
        const int64_t k0 = g * group + j * kActBlock, k1 = std::min(gk1, k0 + kActBlock);
        if (k0 >= k1) break;
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k += 8)
          vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
        const auto [inv, scale] = act_scale(tmvec::reduce_max(Vec(vmax)), finite);
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i vsum = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += 8) {
          const __m256i xq = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv));
          vsum = _mm256_add_epi32(vsum, xq);
          // 8 dwords -> 8 words (pack within lanes, then lanes 0 and 2; |xq| <= 16383)
          const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(xq, xq), 0x08);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(x16_all + m * K + k),
                           _mm256_castsi256_si128(w));
        }
        alignas(32) uint32_t lanes8[8];  // (unsigned: a NaN row's sums wrap, harmlessly)
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes8), vsum);
        uint32_t isum = 0;
        for (int i = 0; i < 8; ++i) isum += lanes8[i];
        scales[q.at(m, g, j)] = scale;
        xsums[q.at(m, g, j)] = static_cast<int32_t>(isum);
      }
    }
  }
  return q;
}
#endif

// Closing an activation block, the same at every level: per row and column, the exact
// integer sum of (code - zero) * xq, made as sum(code * xq) - zero * sum(xq) (|each|
// < 2^30), converted to fp32 (exact below 2^24, else rounded as cvtdq2ps) and added to
// the row's output with one FMA: out += sum * (scale * x's scale).
#if defined(TM_VEC_AVX512)
using IAcc = __m512i;  // Vec::W int32 lanes
TM_INLINE IAcc load_acc(const int32_t* p) { return _mm512_loadu_si512(p); }
TM_INLINE IAcc zero_points(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TM_INLINE Vec close_sum(IAcc acc, IAcc zero, int32_t xsum, Vec ssa, Vec out) {
  const IAcc t = _mm512_sub_epi32(acc, _mm512_mullo_epi32(zero, _mm512_set1_epi32(xsum)));
  return tmvec::fma(Vec(_mm512_cvtepi32_ps(t)), ssa, out);
}
#else
using IAcc = __m256i;
TM_INLINE IAcc load_acc(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
TM_INLINE IAcc zero_points(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
TM_INLINE Vec close_sum(IAcc acc, IAcc zero, int32_t xsum, Vec ssa, Vec out) {
  const IAcc t = _mm256_sub_epi32(acc, _mm256_mullo_epi32(zero, _mm256_set1_epi32(xsum)));
  return tmvec::fma(Vec(_mm256_cvtepi32_ps(t)), ssa, out);
}
#endif

// out [R][C] (+ bias) -> y's ncols columns (fp32, or bf16 rounded as c10 rounds).
template <int R, typename T>
TM_INLINE void store_out(const Vec (&out)[R][C], const float* bias, T* y, int64_t ldy,
                         int64_t ncols) {
  for (int c = 0; c < C; ++c) {
    const int n = lanes(ncols, c);
    if (n == 0) continue;
    const Vec bv = bias != nullptr ? Vec::load_n(bias + c * Vec::W, n) : Vec::zero();
    for (int r = 0; r < R; ++r) store_lanes(out[r][c] + bv, y + r * ldy + c * Vec::W, n);
  }
}

#if defined(TM_QUANT_QUAD_VNNI)
// acc += the 4-byte dot products of w (unsigned) and x (signed) per int32 lane. GCC's
// intrinsic gives a fresh register per call, and in the k loop it then copies every
// accumulator twice a step (16 extra moves for one row); the asm updates in place.
TM_INLINE __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, x);
#endif
}

// R rows (from row m0 of xq) against one block, into y (stride ldy). The fp32 outputs
// stay in registers across groups; 8 k (one 4-bit line, two 8-bit ones) per step.
template <int R, int BITS, typename S, typename T>
void quad_micro(const QuadX& xq, int64_t m0, const QBlock<S>& b, const float* bias,
                T* y, int64_t ldy, int64_t ncols) {
  // One or two rows: a second set of sums for the step's second quad, so that each
  // sum's chain of vpdpbusd is half as long (latency, not throughput, bound them).
  constexpr int U = R <= 2 ? 2 : 1;
  // 4-bit with two sets: the second set's quads are the high nibbles, multiplied where
  // they lie (16 x code, below 256: a mask, no shift); its sums are 16 x theirs, exact,
  // divided back when the block closes (|sums| < 2^22: no overflow).
  constexpr bool kHigh16 = BITS == 4 && U == 2;
  Vec out[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = Vec::zero();
  const __m512i nib = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < b.G; ++g) {
    const int64_t gk1 = std::min(b.K, (g + 1) * b.group);
    for (int64_t j = 0; j < xq.bpg; ++j) {
      const int64_t k0 = g * b.group + j * kActBlock, k1 = std::min(gk1, k0 + kActBlock);
      if (k0 >= k1) break;
      __m512i ah[U][R][2], al[U][R][2];
      for (int u = 0; u < U; ++u)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < 2; ++c) ah[u][r][c] = al[u][r][c] = _mm512_setzero_si512();
      constexpr int64_t kStep = 8 / kQuadK<BITS> * kQuadLine;  // code bytes per 8 k
      const uint8_t* line = b.codes + k0 / kQuadK<BITS> * kQuadLine;
      const int32_t* xhi = xq.hi + m0 * xq.nq + k0 / 4;  // the step's two quads' dwords
      const int32_t* xlo = xq.lo + m0 * xq.nq + k0 / 4;
      for (int64_t step = (k1 - k0) / 8; step > 0; --step, line += kStep, xhi += 2, xlo += 2) {
        // a lone row streams the weights: keep 8 KB ahead, one prefetch per 64 bytes
        for (int64_t off = 0; off < kStep; off += 64) tmvec::prefetch(line + 8192 + off);
        __m512i w[2][2];  // [quad i of the step][16-column half]
        for (int c = 0; c < 2; ++c) {
          if constexpr (BITS == 8) {
            w[0][c] = _mm512_loadu_si512(line + c * 64);
            w[1][c] = _mm512_loadu_si512(line + kQuadLine + c * 64);
          } else {
            const __m512i v = _mm512_loadu_si512(line + c * 64);
            w[0][c] = _mm512_and_si512(v, nib);
            // the high nibbles: in place (16 x the code: its own sums, kHigh16) or shifted
            w[1][c] = kHigh16 ? _mm512_andnot_si512(nib, v)
                              : _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          }
        }
        for (int i = 0; i < 2; ++i) {
          for (int r = 0; r < R; ++r) {
            const __m512i xh = _mm512_set1_epi32(xhi[r * xq.nq + i]);
            const __m512i xl = _mm512_set1_epi32(xlo[r * xq.nq + i]);
            for (int c = 0; c < 2; ++c) {
              __m512i& h = ah[U == 2 ? i : 0][r][c];
              __m512i& l = al[U == 2 ? i : 0][r][c];
              h = dpbusd(h, w[i][c], xh);
              l = dpbusd(l, w[i][c], xl);
            }
          }
        }
      }
      for (int c = 0; c < C; ++c) {
        const Vec s = load_scale<BITS>(b.scales + g * NB + c * Vec::W);
        const IAcc z = zero_points(b.zeros + g * NB + c * Vec::W);
        for (int r = 0; r < R; ++r) {
          __m512i h = ah[0][r][c], l = al[0][r][c];
          if constexpr (kHigh16) {
            h = _mm512_add_epi32(h, _mm512_srai_epi32(ah[1][r][c], 4));
            l = _mm512_add_epi32(l, _mm512_srai_epi32(al[1][r][c], 4));
          } else if constexpr (U == 2) {
            h = _mm512_add_epi32(h, ah[1][r][c]);
            l = _mm512_add_epi32(l, al[1][r][c]);
          }
          const int64_t at = xq.at(m0 + r, g, j);
          // hi * 128 + lo: the sums of code * xq
          out[r][c] = close_sum(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l), z, xq.xsum[at],
                                s * Vec::set1(xq.scale[at]), out[r][c]);
        }
      }
    }
  }
  store_out<R>(out, bias, y, ldy, ncols);
}

constexpr int QUAD_MR = 4;  // rows per call: 4 x 2 x 2 int32 sums, 4 weight vectors

template <int BITS, typename S, typename T, int R>
void quad_tail(const QuadX& xq, int64_t m0, const QBlock<S>& b, const float* bias, T* y,
               int64_t ldy, int64_t rows, int64_t ncols) {
  if constexpr (R > 1) {
    if (rows == R - 1) return quad_micro<R - 1, BITS>(xq, m0, b, bias, y, ldy, ncols);
    return quad_tail<BITS, S, T, R - 1>(xq, m0, b, bias, y, ldy, rows, ncols);
  }
}
#else  // vpmaddwd on zero-extended codes

#if defined(TM_VEC_AVX512)
using IVec = __m512i;
constexpr int kIvCols = 8;  // columns per int16 vector: 32 code bytes = 8 columns x 4 k
TM_INLINE IVec widen_codes(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TM_INLINE IVec bcast_quad(const int16_t* x) {  // x[0..3] in every 64-bit lane
  int64_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm512_set1_epi64(v);
}
TM_INLINE IVec madd_acc(IVec acc, IVec w, IVec x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
}
TM_INLINE IVec low_nibbles(IVec w) { return _mm512_and_si512(w, _mm512_set1_epi16(0xf)); }
TM_INLINE IVec high_nibbles(IVec w) { return _mm512_srli_epi16(w, 4); }
// a: columns 0..7, b: columns 8..15, two partial sums each (adjacent lanes) -> 16 sums
TM_INLINE void store_pair_sums(IVec a, IVec b, int32_t* out) {
  a = _mm512_add_epi32(a, _mm512_srli_epi64(a, 32));  // lane 2i: column i's sum
  b = _mm512_add_epi32(b, _mm512_srli_epi64(b, 32));
  const IVec even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                      28, 30);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi32(a, even, b));
}
#else  // AVX2
using IVec = __m256i;
constexpr int kIvCols = 4;  // 16 code bytes = 4 columns x 4 k
TM_INLINE IVec widen_codes(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TM_INLINE IVec bcast_quad(const int16_t* x) {
  int64_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm256_set1_epi64x(v);
}
TM_INLINE IVec madd_acc(IVec acc, IVec w, IVec x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}
TM_INLINE IVec low_nibbles(IVec w) { return _mm256_and_si256(w, _mm256_set1_epi16(0xf)); }
TM_INLINE IVec high_nibbles(IVec w) { return _mm256_srli_epi16(w, 4); }
// a: columns 0..3, b: columns 4..7 -> 8 sums (hadd gives 0 1 4 5 | 2 3 6 7)
TM_INLINE void store_pair_sums(IVec a, IVec b, int32_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xd8));
}
#endif

// R rows (from row m0 of xq) against one block, into y (stride ldy), CP columns at a
// time (a slab: R x CP / kIvCols int32 accumulators must stay in registers; the
// slabs after the first read the activation block's lines from L1).
template <int R, int CP, int BITS, typename S, typename T>
void quad_micro(const QuadX& xq, int64_t m0, const QBlock<S>& b, const float* bias,
                T* y, int64_t ldy, int64_t ncols) {
  static_assert(NB % CP == 0 && CP % (2 * kIvCols) == 0);
  constexpr int64_t kq = kQuadK<BITS>;
  constexpr int NV = CP / kIvCols;
  Vec out[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = Vec::zero();
  alignas(64) int32_t acc32[R * NB];
  const int16_t* x16 = xq.x16 + m0 * xq.K;
  for (int64_t g = 0; g < b.G; ++g) {
    const int64_t gk1 = std::min(b.K, (g + 1) * b.group);
    for (int64_t j = 0; j < xq.bpg; ++j) {
      const int64_t k0 = g * b.group + j * kActBlock, k1 = std::min(gk1, k0 + kActBlock);
      if (k0 >= k1) break;
      for (int c0 = 0; c0 < NB; c0 += CP) {
        IVec acc[R][NV];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < NV; ++v) acc[r][v] = IVec{};
        for (int64_t k = k0; k < k1; k += kq) {
          const uint8_t* line = b.codes + (k / kq) * kQuadLine;
          if (c0 == 0) {  // the first slab streams the weights: keep 8 KB ahead
            tmvec::prefetch(line + 8192);
            tmvec::prefetch(line + 8192 + 64);
          }
          line += c0 * 4;
          IVec xa[R], xb[R];
          for (int r = 0; r < R; ++r) {
            xa[r] = bcast_quad(x16 + r * xq.K + k);
            if constexpr (BITS == 4) xb[r] = bcast_quad(x16 + r * xq.K + k + 4);
          }
          for (int v = 0; v < NV; ++v) {
            const IVec w = widen_codes(line + v * kIvCols * 4);
            if constexpr (BITS == 8) {
              for (int r = 0; r < R; ++r) acc[r][v] = madd_acc(acc[r][v], w, xa[r]);
            } else {
              const IVec wl = low_nibbles(w), wh = high_nibbles(w);
              for (int r = 0; r < R; ++r)
                acc[r][v] = madd_acc(madd_acc(acc[r][v], wl, xa[r]), wh, xb[r]);
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < NV; v += 2)
            store_pair_sums(acc[r][v], acc[r][v + 1], acc32 + r * NB + c0 + v * kIvCols);
      }
      for (int c = 0; c < C; ++c) {
        const Vec s = load_scale<BITS>(b.scales + g * NB + c * Vec::W);
        const IAcc z = zero_points(b.zeros + g * NB + c * Vec::W);
        for (int r = 0; r < R; ++r) {
          const int64_t at = xq.at(m0 + r, g, j);
          out[r][c] = close_sum(load_acc(acc32 + r * NB + c * Vec::W), z, xq.xsum[at],
                                s * Vec::set1(xq.scale[at]), out[r][c]);
        }
      }
    }
  }
  store_out<R>(out, bias, y, ldy, ncols);
}
#endif  // TM_QUANT_QUAD_VNNI

// Inputs of this many rows and more skip the integer dot products: the block is
// dequantized once into fp32 and multiplied exactly, as the widening kernel does from
// DEQUANT_MIN_ROWS (the platform keeps up to 64 rows in the quad kernel at avx512_vnni,
// where it was measured ahead of dequantized tiles; where the tiles' GEMM runs in fp32,
// up to 256 rows reach this kernel, as they reach the widening one).
constexpr int64_t QUAD_DEQUANT_MIN_ROWS = 65;
// With AVX2's vpmaddwd 4-bit codes stop paying sooner: a pass takes two rows (16
// registers), and each pass widens and splits the block's nibbles again, where the
// dequantized block is made once. Measured on the AVX2-only EPYC (Zen 3), 2 threads,
// ms quad / dequantized (the plain layout's path), int4 group 32: 3072 x 512 at 24 rows
// 0.98 / 0.75, 32 rows 1.30 / 0.97, 64 rows 2.63 / 1.76; 4096 x 4096 at 24 rows 5.7 /
// 6.2, 32 rows 12.8 / 8.3, 64 rows 26.8 / 15.2; int8 stays level or ahead up to 64.
inline int64_t quad_dequant_min_rows(int64_t bits) {
#if defined(TM_QUANT_QUAD_MADD) && !defined(TM_VEC_AVX512)
  if (bits == 4) return 32;
#endif
  (void)bits;
  return QUAD_DEQUANT_MIN_ROWS;
}

// All `rows` rows of xq against one block into y (stride ldy).
template <int BITS, typename S, typename T>
void quad_block_rows(const QuadX& xq, const QBlock<S>& b, const float* bias, T* y,
                     int64_t ldy, int64_t rows, int64_t ncols) {
#if defined(TM_QUANT_QUAD_VNNI)
  int64_t m = 0;
  for (; m + QUAD_MR <= rows; m += QUAD_MR)
    quad_micro<QUAD_MR, BITS>(xq, m, b, bias, y + m * ldy, ldy, ncols);
  if (m < rows)
    quad_tail<BITS, S, T, QUAD_MR>(xq, m, b, bias, y + m * ldy, ldy, rows - m, ncols);
#elif defined(TM_VEC_AVX512)
  // 32 zmm: 4 rows x 4 accumulators of the whole block, their x's and the codes
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) quad_micro<4, 32, BITS>(xq, m, b, bias, y + m * ldy, ldy, ncols);
  for (; m + 2 <= rows; m += 2) quad_micro<2, 32, BITS>(xq, m, b, bias, y + m * ldy, ldy, ncols);
  if (m < rows) quad_micro<1, 32, BITS>(xq, m, b, bias, y + m * ldy, ldy, ncols);
#else
  // 16 ymm: one row's 8 accumulators of the block, or 2 rows' of a 16-column slab
  int64_t m = 0;
  for (; m + 2 <= rows; m += 2) quad_micro<2, 16, BITS>(xq, m, b, bias, y + m * ldy, ldy, ncols);
  if (m < rows) quad_micro<1, 32, BITS>(xq, m, b, bias, y + m * ldy, ldy, ncols);
#endif
}

// Column blocks per thread at least (at::parallel_for's grain): a split whose share is
// under kQuadMinSplitWeights weights x rows costs more in fork and join than it saves
// (measured: one 512 x 512 int4 row took longer on two threads than on one). Inside a
// team (parallel.h) a split costs about a tenth as much: kTeamMinSplitWeights there.
constexpr int64_t kQuadMinSplitWeights = 256 * 1024, kTeamMinSplitWeights = 32 * 1024;
inline int64_t quad_grain(int64_t K, int64_t rows) {
  const int64_t least = tmpar::team_size() > 0 ? kTeamMinSplitWeights : kQuadMinSplitWeights;
  return std::max<int64_t>(1, (least + K * NB * rows - 1) / (K * NB * rows));
}

// W dwords of the quad layout from p (W columns of one line), byte / nibble `shift / 4`
// of each, widened to fp32: the codes of W columns at one k (dequantize_quad_block).
TM_INLINE Vec quad_code_lanes(const uint8_t* p, int shift, int mask) {
#if defined(TM_VEC_AVX512)
  const __m512i d = _mm512_loadu_si512(p);
  return Vec(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(d, _mm_cvtsi32_si128(shift)),
                                                 _mm512_set1_epi32(mask))));
#else
  const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(d, _mm_cvtsi32_si128(shift)),
                                                 _mm256_set1_epi32(mask))));
#endif
}

template <int BITS, typename S, typename T>
void dequantize_quad_block(const QBlock<S>& b, T* out, int64_t ld, int64_t ncols) {
  constexpr int64_t kq = kQuadK<BITS>;
  for (int64_t g = 0; g < b.G; ++g) {
    const int64_t k1 = std::min(b.K, (g + 1) * b.group);
    for (int c = 0; c < C; ++c) {
      const int n = lanes(ncols, c);
      if (n == 0) continue;
      const Vec s = load_scale<BITS>(b.scales + g * NB + c * Vec::W);
      const Vec z = tmvec::load_u8(b.zeros + g * NB + c * Vec::W);
      for (int64_t k = g * b.group; k < k1; k += kq) {
        const uint8_t* p = b.codes + (k / kq) * kQuadLine + c * Vec::W * 4;
        for (int i = 0; i < kq; ++i) {  // 4-bit: k 8o + i < 4 low nibbles, else high ones
          const int shift = BITS == 8 ? 8 * i : 8 * (i % 4) + 4 * (i / 4);
          const Vec w = quad_code_lanes(p, shift, BITS == 8 ? 0xff : 0xf);
          store_lanes((w - z) * s, out + (k + i) * ld + c * Vec::W, n);
        }
      }
    }
  }
}
#endif  // TM_QUANT_QUAD

// All `rows` rows of x against one block into y (stride ldy). `quad`: the block is in
// the quad layout (only dequantized here: rows >= quad_dequant_min_rows).
template <int BITS, typename S>
void block_rows(const float* x, const float* xs, const QBlock<S>& b, const float* bias,
                float* y, int64_t ldy, int64_t rows, int64_t ncols,
                std::vector<float>& scratch, bool quad) {
  const int64_t K = b.K;
  const int64_t ldxs = kHasZeros<BITS> ? b.G : 0;  // e4m3: xs is empty
  if (quad) {
#if defined(TM_QUANT_QUAD)
    if constexpr (BITS != kQuantE4m3) {
      scratch.resize(K * NB);
      dequantize_quad_block<BITS>(b, scratch.data(), NB, NB);
      return dequantized_rows(x, scratch.data(), K, bias, y, ldy, rows, ncols);
    }
#endif
    TORCH_CHECK(false, "linear_quant: no quad layout here");
  }
  if (rows == 1) return micro_row<BITS>(x, xs, b, bias, y, ncols);
  if (rows < DEQUANT_MIN_ROWS) {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
      micro<MR, BITS>(x + m * K, K, xs + m * ldxs, ldxs, b, bias, y + m * ldy, ldy, ncols);
    if (m < rows)
      rows_tail<BITS, S, MR>(x + m * K, K, xs + m * ldxs, ldxs, b, bias, y + m * ldy, ldy,
                             rows - m, ncols);
    return;
  }
  scratch.resize(K * NB);
  dequantize_block<BITS>(b, scratch.data(), NB, NB);
  dequantized_rows(x, scratch.data(), K, bias, y, ldy, rows, ncols);
}

// Calls f(bits tag, scale type tag) for the packed weight's kind and scale dtype.
template <typename F>
void dispatch(int64_t bits, at::ScalarType scale_type, F&& f) {
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, 8>;
  using E4m3 = std::integral_constant<int, kQuantE4m3>;
  const bool half = scale_type == at::kHalf;
  if (bits == 8) {
    if (half) f(I8{}, c10::Half{}); else f(I8{}, float{});
  } else if (bits == kQuantE4m3) {
    if (half) f(E4m3{}, c10::Half{}); else f(E4m3{}, float{});
  } else {
    if (half) f(I4{}, c10::Half{}); else f(I4{}, float{});
  }
}

bool known_kind(int64_t bits) { return bits == 4 || bits == 8 || bits == kQuantE4m3; }

struct Packed {
  const uint8_t* codes;
  const void* scales;
  const uint8_t* zeros;
  int64_t nblocks, K, group, G;
  bool quad;  // the quad layout (integer dot products on 15-bit activations)

  template <typename S>
  QBlock<S> block(int64_t b, int bits) const {
    const int64_t line = bits == 4 ? NB / 2 : NB;
    return {codes + b * K * line, static_cast<const S*>(scales) + b * G * NB,
            zeros != nullptr ? zeros + b * G * NB : nullptr, K, group, G};
  }
};

// Checks the packed tensors against each other; -> the view the kernels read.
Packed check_packed(const char* op, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& zeros, int64_t N, int64_t bits, int64_t group) {
  TORCH_CHECK(known_kind(bits), op, ": bits must be 4, 8 or ", kQuantE4m3, " (e4m3), got ",
              bits);
  // The quad layout's lines are 128 bytes, the plain layout's k lines 32 or 16.
  const bool quad = codes.dim() == 3 && codes.size(2) == kQuadLine;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  (codes.size(2) == (bits == 4 ? NB / 2 : NB) || (quad && bits != kQuantE4m3)),
              op, ": codes must come from pack_quant_weight with the same bits");
#if !defined(TM_QUANT_QUAD)
  TORCH_CHECK(!quad, op, ": codes in the quad layout need the avx2 kernel level or above "
              "(this module is ", TOKENMILL_CPU_LEVEL_NAME, ")");
#endif
  const int64_t nb = codes.size(0), K = codes.size(1) * (quad ? (bits == 4 ? 8 : 4) : 1);
  TORCH_CHECK(group > 0, op, ": group_size must be positive");
  TORCH_CHECK(!quad || group % 8 == 0 || group >= K, op,
              ": the quad layout needs a group size that is a multiple of 8 or the whole K");
  const int64_t G = (K + group - 1) / group;
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == nb &&
                  scales.size(1) == G && scales.size(2) == NB &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              op, ": scales must be [N/32, G, 32] fp32 or fp16 from pack_quant_weight");
  if (bits == kQuantE4m3) {
    TORCH_CHECK(!zeros.defined() || zeros.numel() == 0, op,
                ": zeros must be empty for e4m3 weights (no zero point)");
  } else {
    TORCH_CHECK(zeros.dim() == 3 && zeros.is_contiguous() && zeros.scalar_type() == at::kByte &&
                    zeros.size(0) == nb && zeros.size(1) == G && zeros.size(2) == NB,
                op, ": zeros must be [N/32, G, 32] uint8 from pack_quant_weight");
  }
  TORCH_CHECK(N > 0 && N <= nb * NB && N > (nb - 1) * NB, op, ": bad column count ", N);
  return {codes.data_ptr<uint8_t>(), scales.data_ptr(),
          bits == kQuantE4m3 ? nullptr : zeros.data_ptr<uint8_t>(), nb, K, group, G, quad};
}

// [N, X] -> [N/32 * 32, X] zero padded, viewed as [N/32, 32, X] -> [N/32, X, 32].
torch::Tensor blocks_of(const torch::Tensor& t) {
  const int64_t N = t.size(0), nb = (N + NB - 1) / NB;
  auto padded = torch::zeros({nb * NB, t.size(1)}, t.options());
  padded.narrow(0, 0, N).copy_(t);
  return padded.view({nb, NB, t.size(1)}).permute({0, 2, 1}).contiguous();
}

#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
// ---- Many bf16 rows on vdpbf16ps (linear_quant_dot) ----
//
// Why: from a few dozen rows a call is bound by arithmetic, and vdpbf16ps does twice the
// products per instruction of the fp32 FMAs above. Dequantizing tiles of W' for the
// library GEMM writes and re-reads them and the GEMM repacks them each call; here each
// block's codes become bf16(W') pair words in cpu_linear_dot.cpp's scratch directly,
// the values dequantize_quant(bf16=True) gives ((code - zero) * scale in fp32, rounded
// to nearest even), and its driver and micro-kernel do the rest.

// The codes of the 32 columns at k, widened to fp32 (c: columns 16c .. 16c + 15).
template <int BITS, bool QUAD>
TM_INLINE void block_codes_at(const uint8_t* codes, int64_t k, Vec* out) {
#if defined(TM_QUANT_QUAD)
  if constexpr (QUAD && BITS != kQuantE4m3) {
    constexpr int64_t kq = kQuadK<BITS>;
    const uint8_t* p = codes + (k / kq) * kQuadLine;
    const int i = static_cast<int>(k % kq);  // 4-bit: i < 4 low nibbles, else high ones
    const int shift = BITS == 8 ? 8 * i : 8 * (i % 4) + 4 * (i / 4);
    for (int c = 0; c < C; ++c)
      out[c] = quad_code_lanes(p + c * Vec::W * 4, shift, BITS == 8 ? 0xff : 0xf);
    return;
  }
#endif
  codes_at<BITS>(codes, k, out);
}

// Whether every W' of a group with these (loaded) scales converts to bf16 by
// vcvtne2ps2bf16 exactly as c10 rounds it: that instruction also rounds to nearest
// even but reads denormal inputs as zero and writes NaNs of its own, so it serves only
// where no W' is a denormal or NaN: every scale zero, or finite with |scale| * the
// smallest nonzero |code - zero| (1; e4m3: 2^-9, read as 2^-17 against scale x 2^8)
// at least FLT_MIN. Real checkpoints' scales always are; others take c10's rounding.
// (vdpbf16ps itself reads denormal bf16s as zero, so the outputs would not differ; the
// scratch's values stay dequantize_quant(bf16=True)'s all the same.)
template <int BITS>
TM_INLINE bool fast_bf16(const Vec* s) {
  const __m512 lo = _mm512_set1_ps(BITS == kQuantE4m3 ? 0x1p-109f : 0x1p-126f);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __mmask16 ok = 0xffff;
  for (int c = 0; c < C; ++c) {
    const __m512 a = _mm512_abs_ps(s[c].v);
    ok &= (_mm512_cmp_ps_mask(a, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ)) |
          _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ);
  }
  return ok == 0xffff;
}

template <int BITS, typename S, bool QUAD>
struct QuantPairs final : DotPairSource {
  const Packed& p;
  explicit QuantPairs(const Packed& packed) : p(packed) {}

  void pairs(int64_t blk, int64_t p0, int64_t np, uint32_t* dst) const override {
    const QBlock<S> b = p.block<S>(blk, BITS);  // (quad blocks: the same bytes)
    Vec s[C], z[C];
    bool fast = false;
    int64_t kend = -1;  // the end of the group whose scale / zero are loaded
    constexpr __mmask32 kHigh = 0xAAAAAAAAu;  // the high bf16 of every dword
    // vcvtne2ps2bf16(k odd, k even) -> words [even 0..15, odd 0..15]; word 2c of the pair
    // vector is the even k's column c, word 2c + 1 the odd one's
    alignas(64) static constexpr uint16_t kPairIdx[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pair_idx = _mm512_load_si512(kPairIdx);
    for (int64_t q = 0; q < np; ++q) {
      Vec v[2][C];  // W' at k = 2p, 2p + 1
      for (int j = 0; j < 2; ++j) {
        const int64_t k = 2 * (p0 + q) + j;
        if (k >= b.K) {
          for (int c = 0; c < C; ++c) v[j][c] = Vec::zero();
          continue;
        }
        if (k >= kend) {
          const int64_t g = k / b.group;
          kend = std::min(b.K, (g + 1) * b.group);
          for (int c = 0; c < C; ++c) {
            s[c] = load_scale<BITS>(b.scales + g * NB + c * Vec::W);
            if constexpr (kHasZeros<BITS>) z[c] = tmvec::load_u8(b.zeros + g * NB + c * Vec::W);
          }
          // (a pair across two groups: both must allow it; the rest of the second
          // group then keeps the exact path too, equally right)
          fast = fast_bf16<BITS>(s) && (j == 0 || fast);
        }
        Vec w[C];
        block_codes_at<BITS, QUAD>(b.codes, k, w);
        for (int c = 0; c < C; ++c) {
          if constexpr (kHasZeros<BITS>) v[j][c] = (w[c] - z[c]) * s[c];
          else v[j][c] = w[c] * s[c];
        }
      }
      for (int c = 0; c < C; ++c) {
        __m512i pw;
        if (fast) {
          pw = _mm512_permutexvar_epi16(
              pair_idx, (__m512i)_mm512_cvtne2ps_pbh(v[1][c].v, v[0][c].v));
        } else {  // c10's rounding; the shift and the blend keep each dword's high half
          pw = _mm512_mask_blend_epi16(
              kHigh, _mm512_srli_epi32(_mm512_castps_si512(v[0][c].round_bf16().v), 16),
              _mm512_castps_si512(v[1][c].round_bf16().v));
        }
        _mm512_storeu_si512(dst + q * NB + c * Vec::W, pw);
      }
    }
  }
};
#endif

}  // namespace

bool has_quant_quad() {
#if defined(TM_QUANT_QUAD)
  return true;
#else
  return false;
#endif
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> pack_quant_weight(
    torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
    int64_t group_size, bool quad) {
  TORCH_CHECK(known_kind(bits), "pack_quant_weight: bits must be 4, 8 or ", kQuantE4m3,
              " (e4m3), got ", bits);
#if !defined(TM_QUANT_QUAD)
  TORCH_CHECK(!quad, "pack_quant_weight: the quad layout needs the avx2 kernel level or above "
              "(this module is ", TOKENMILL_CPU_LEVEL_NAME, ")");
#endif
  const bool e4m3 = bits == kQuantE4m3;
  if (e4m3 && codes.scalar_type() == at::kFloat8_e4m3fn) codes = codes.view(at::kByte);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte,
              "pack_quant_weight: codes must be uint8 [N, K]",
              e4m3 ? " (or float8_e4m3fn)" : "");
  TORCH_CHECK(group_size > 0, "pack_quant_weight: group_size must be positive");
  const int64_t N = codes.size(0), K = codes.size(1), G = (K + group_size - 1) / group_size;
  TORCH_CHECK(N > 0 && K > 0, "pack_quant_weight: empty weight");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G &&
                  scales.scalar_type() == at::kFloat,
              "pack_quant_weight: scales must be fp32 [N, ceil(K / group_size)]");
  if (e4m3) {
    TORCH_CHECK(!zeros.defined() || zeros.numel() == 0,
                "pack_quant_weight: zeros must be empty for e4m3 weights (no zero point)");
    // 0x7f / 0xff: NaN, which the fp16-based widening reads as +-480 (vec_fp8.h)
    TORCH_CHECK(!codes.bitwise_and(0x7f).eq(0x7f).any().item<bool>(),
                "pack_quant_weight: an e4m3 code is NaN (0x7f / 0xff)");
    // The kernels read scale x 2^8 (load_scale): exact below 2^120.
    TORCH_CHECK(scales.abs().lt(0x1p120f).all().item<bool>(),
                "pack_quant_weight: e4m3 scales must be finite and below 2^120 in magnitude");
  } else {
    TORCH_CHECK(zeros.dim() == 2 && zeros.size(0) == N && zeros.size(1) == G &&
                    zeros.scalar_type() == at::kByte,
                "pack_quant_weight: zeros must be uint8 [N, ceil(K / group_size)]");
  }
  if (bits == 4)
    TORCH_CHECK(codes.max().item<uint8_t>() <= 15 && zeros.max().item<uint8_t>() <= 15,
                "pack_quant_weight: a 4-bit code or zero point exceeds 15");
  if (quad) {
    TORCH_CHECK(bits != kQuantE4m3 && K % 8 == 0 && (group_size % 8 == 0 || group_size >= K),
                "pack_quant_weight: the quad layout takes 4- or 8-bit codes with K a multiple "
                "of 8 and a group size that is a multiple of 8 or the whole K");
  }
  torch::Tensor w = blocks_of(codes);  // [nb, K, 32]
  const int64_t nb = w.size(0);
  if (quad && bits == 8) {  // [nb, K/4, 4, 32] -> [nb, K/4, 32 columns, 4 k]
    w = w.view({nb, K / 4, 4, NB}).permute({0, 1, 3, 2}).reshape({nb, K / 4, kQuadLine});
  } else if (quad) {  // k 8o + j in the low nibble, 8o + 4 + j in the high one
    auto o = w.view({nb, K / 8, 8, NB});
    w = o.narrow(2, 0, 4).bitwise_or(o.narrow(2, 4, 4).bitwise_left_shift(4))
            .permute({0, 1, 3, 2}).reshape({nb, K / 8, kQuadLine});
  } else if (bits == 4) {  // byte i = column i | column 16 + i << 4
    w = w.narrow(2, 0, NB / 2).bitwise_or(w.narrow(2, NB / 2, NB / 2).bitwise_left_shift(4))
            .contiguous();
  }
  torch::Tensor s = blocks_of(scales.contiguous());
  torch::Tensor s16 = s.to(at::kHalf);
  if (s16.to(at::kFloat).equal(s)) s = s16;  // exactly fp16: half the bytes
  return {w, s, e4m3 ? torch::empty({0}, codes.options()) : blocks_of(zeros)};
}

torch::Tensor linear_quant(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           torch::Tensor zeros, int64_t N, int64_t bits, int64_t group_size,
                           torch::Tensor bias) {
  const Packed p = check_packed("linear_quant", codes, scales, zeros, N, bits, group_size);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.K, "linear_quant: x must be [M, K]");
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "linear_quant: x must be fp32 or bf16");
  const int64_t M = x.size(0), K = p.K, G = p.G;
  // bf16 rows are widened here, without an ATen op (a decode step makes many calls).
  torch::Tensor xc = x.contiguous();
  // Into the calling thread's buffer, reused from call to call up to 16 MB (a decode
  // step makes dozens of calls; 32 rows of K = 4096 in a fresh allocation page-faulted
  // on every call), by every thread when there are many values.
  thread_local std::vector<float> xbuf_kept;
  std::vector<float> xbuf_big;
  std::vector<float>& xbuf = M * K <= (1 << 22) ? xbuf_kept : xbuf_big;
  const float* xp;
  if (out_dtype == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    if (static_cast<int64_t>(xbuf.size()) < M * K) xbuf.resize(M * K);
    widen_bf16(xc.data_ptr<c10::BFloat16>(), xbuf.data(), M * K);
    xp = xbuf.data();
  }
  torch::Tensor bias_hold;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == N, "linear_quant: bias must be [N]");
    bias_hold = bias.to(at::kFloat).contiguous();
    bp = bias_hold.data_ptr<float>();
  }
#if defined(TM_QUANT_QUAD)
  if (p.quad && M < quad_dequant_min_rows(bits)) {
    torch::Tensor out = torch::empty({M, N}, x.options());
    if (M == 0) return out;
    const QuadX xq = quantize_x(xp, M, K, group_size, G);
    const int64_t grain = quad_grain(K, M);
    dispatch(bits, scales.scalar_type(), [&](auto bits_tag, auto scale_tag) {
      constexpr int BITS = decltype(bits_tag)::value;
      using S = decltype(scale_tag);
      if constexpr (BITS != kQuantE4m3) {
        auto run = [&](auto* yp) {  // fp32 or bf16 outputs, written in place
          tmpar::parallel_for(0, p.nblocks, grain, [&](int64_t b0, int64_t b1) {
            for (int64_t blk = b0; blk < b1; ++blk) {
              const int64_t n0 = blk * NB;
              quad_block_rows<BITS>(xq, p.block<S>(blk, BITS),
                                    bp != nullptr ? bp + n0 : nullptr, yp + n0, N, M,
                                    std::min(NB, N - n0));
            }
          });
        };
        if (out_dtype == at::kFloat) run(out.data_ptr<float>());
        else run(out.data_ptr<c10::BFloat16>());
      }
    });
    return out;
  }
#endif
  // Per row and group, the sum of x (closes each group's sums of x * code; e4m3 has
  // no zero point to close with).
  const int64_t xs_rows = M < DEQUANT_MIN_ROWS && bits != kQuantE4m3 && !p.quad ? M : 0;
  std::vector<float> xs(xs_rows * G);
  for (int64_t m = 0; m < xs_rows; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * group_size; k < std::min(K, (g + 1) * group_size); ++k)
        s += xp[m * K + k];
      xs[m * G + g] = s;
    }
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  float* yp = out_dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  dispatch(bits, scales.scalar_type(), [&](auto bits_tag, auto scale_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    using S = decltype(scale_tag);
    tmpar::parallel_for(0, p.nblocks, 1, [&](int64_t b0, int64_t b1) {
      // (per thread, reused: a dequantized block of K = 4096 is 512 KB)
      thread_local std::vector<float> tile, scratch;
      if (yp == nullptr && static_cast<int64_t>(tile.size()) < M * NB) tile.resize(M * NB);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * NB, ncols = std::min(NB, N - n0);
        const QBlock<S> qb = p.block<S>(blk, BITS);
        const float* bias_b = bp != nullptr ? bp + n0 : nullptr;
        if (yp != nullptr) {
          block_rows<BITS>(xp, xs.data(), qb, bias_b, yp + n0, N, M, ncols, scratch, p.quad);
        } else {
          block_rows<BITS>(xp, xs.data(), qb, bias_b, tile.data(), NB, M, ncols, scratch,
                           p.quad);
          auto* ob = out.data_ptr<c10::BFloat16>() + n0;
          for (int64_t r = 0; r < M; ++r)
            for (int64_t n = 0; n < ncols; ++n) ob[r * N + n] = c10::BFloat16(tile[r * NB + n]);
        }
      }
    });
  });
  return out;
}

torch::Tensor dequantize_quant(torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                               int64_t N, int64_t bits, int64_t group_size, int64_t r0,
                               int64_t r1, bool bf16) {
  const Packed p = check_packed("dequantize_quant", codes, scales, zeros, N, bits, group_size);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= N && r0 % NB == 0, "dequantize_quant: rows ", r0,
              ":", r1, " outside 0:", N, " or not starting at a multiple of 32");
  const int64_t K = p.K, cols = r1 - r0;
  torch::Tensor out = torch::empty({K, cols},
                                   codes.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (cols == 0) return out;
  auto run = [&](auto* op) {
    dispatch(bits, scales.scalar_type(), [&](auto bits_tag, auto scale_tag) {
      constexpr int BITS = decltype(bits_tag)::value;
      using S = decltype(scale_tag);
      at::parallel_for(r0 / NB, (r1 - 1) / NB + 1, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const QBlock<S> qb = p.block<S>(blk, BITS);
          const int64_t ncols = std::min(NB, r1 - blk * NB);
#if defined(TM_QUANT_QUAD)
          if constexpr (BITS != kQuantE4m3) {
            if (p.quad) {
              dequantize_quad_block<BITS>(qb, op + (blk * NB - r0), cols, ncols);
              continue;
            }
          }
#endif
          dequantize_block<BITS>(qb, op + (blk * NB - r0), cols, ncols);
        }
      });
    });
  };
  if (bf16) run(out.data_ptr<c10::BFloat16>()); else run(out.data_ptr<float>());
  return out;
}

bool has_quant_dot() { return linear_bf16_dot_rows() > 0; }

torch::Tensor linear_quant_dot(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               torch::Tensor zeros, int64_t N, int64_t bits, int64_t group_size,
                               torch::Tensor bias, bool fp32_out) {
  const Packed p = check_packed("linear_quant_dot", codes, scales, zeros, N, bits, group_size);
  TORCH_CHECK(has_quant_dot(), "linear_quant_dot: not built at this level (",
              TOKENMILL_CPU_LEVEL_NAME, ")");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.K && x.scalar_type() == at::kBFloat16,
              "linear_quant_dot: x must be bf16 [M, K]");
  const int64_t M = x.size(0);
  torch::Tensor bias_hold;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == N, "linear_quant_dot: bias must be [N]");
    bias_hold = bias.to(at::kFloat).contiguous();
    bp = bias_hold.data_ptr<float>();
  }
  torch::Tensor out = torch::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
  torch::Tensor xc = x.contiguous();
  float* yf = fp32_out ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* yb = fp32_out ? nullptr : out.data_ptr<c10::BFloat16>();
  dispatch(bits, scales.scalar_type(), [&](auto bits_tag, auto scale_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    using S = decltype(scale_tag);
    if (p.quad) {
      linear_dot_gemm(xc.data_ptr<c10::BFloat16>(), M, p.K, N, QuantPairs<BITS, S, true>(p),
                      bp, yf, yb);
    } else {
      linear_dot_gemm(xc.data_ptr<c10::BFloat16>(), M, p.K, N, QuantPairs<BITS, S, false>(p),
                      bp, yf, yb);
    }
  });
#endif
  return out;
}
