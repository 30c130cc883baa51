// Paged decode attention for CPU: reads K/V straight from the cache blocks
// through the block table (no gather copy), fp32 accumulation, one job per
// (row, kv head) spread over the intra-op threads - or one per row when there
// are enough rows. Written once against vec.h's W-lane Vec, so every capability
// level runs it vectorised (AVX-512 16 lanes, AVX2 8, NEON / SSE2 4).
//
// head_dim 64, 128 (and 256 with AVX-512) have kernels whose head dimension is a
// compile-time number of vectors: the queries of a block of query heads stay in
// registers (or on the stack where the ISA has too few), and the output accumulators
// of a tile of the head dimension stay in registers across a cache block's tokens.
// Any other head_dim takes a loop over W-lane chunks and a scalar tail.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "vec_fp8.h"

namespace {

using tmvec::Vec;
constexpr int W = Vec::W;

template <typename T>
struct Cache {
  const T* data;
  const int32_t* block_table;  // [rows, max_nb]
  int64_t max_nb, bs, s_block, s_kv, s_tok, s_head;
  // Head h's K (value = false) or V of the block_index-th block of row r.
  const T* at(int64_t r, int64_t block_index, int64_t h, bool value) const {
    return data + block_table[r * max_nb + block_index] * s_block + (value ? s_kv : 0) +
           h * s_head;
  }
};

// ---------------------------------------------------------------- one cache block
// In each function below: n tokens of one kv head from p (token stride s_tok), the
// scores / probabilities of query head j at s[j * ld + token].

// Largest number of head-dim vectors (dividing NV) whose G accumulators fit in half
// the registers: the rest hold the V rows and the broadcast probabilities.
constexpr int value_tile(int NV, int G) {
  int xt = NV;
  while (xt > 1 && (G * xt > Vec::kRegs / 2 || NV % xt != 0)) xt /= 2;
  return xt;
}

// Four heads' scores of a token reduced together (tmvec::reduce_add4) where that was
// measured faster: with AVX-512's 32 registers (1.07-1.36x at GQA 4-8). With AVX2's 16
// the four sums stay live beside spilled rows: 0.88-0.94x there.
constexpr bool kSums4 = Vec::W == 16;

// head_dim = NV vectors, G query heads (q: G rows of NV * W floats).
template <int NV, int G, typename T>
inline void block_scores(const float* q, const T* k, int64_t s_tok, int64_t n, float* s,
                         int64_t ld) {
  // Partial sums per query head: shorter dependency chains than one running sum.
  constexpr int P = NV < 4 ? NV : 4;
  Vec qv[G][NV];
  for (int j = 0; j < G; ++j)
    for (int x = 0; x < NV; ++x) qv[j][x] = Vec::load(q + (j * NV + x) * W);
  for (int64_t o = 0; o < n; ++o, k += s_tok) {
    Vec kv[NV];
    for (int x = 0; x < NV; ++x) kv[x] = tmvec::load_wide(k + x * W);
    auto dot = [&](int j) {  // head j's q . k, as W lane partial sums
      Vec acc[P];
      for (int i = 0; i < P; ++i) acc[i] = qv[j][i] * kv[i];
      for (int x = P; x < NV; ++x) acc[x % P] = tmvec::fma(qv[j][x], kv[x], acc[x % P]);
      for (int w = P / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) acc[i] = acc[i] + acc[i + w];
      return acc[0];
    };
    if constexpr (G == 4 && kSums4) {  // the four heads' lane sums in one transposing tree
      float four[4];
      tmvec::reduce_add4(dot(0), dot(1), dot(2), dot(3), four);
      for (int j = 0; j < 4; ++j) s[j * ld + o] = four[j];
    } else {
      for (int j = 0; j < G; ++j) s[j * ld + o] = tmvec::reduce_add(dot(j));
    }
  }
}

// out (G rows of NV * W floats) += sum over the tokens of p[j][token] * v_token.
template <int NV, int G, typename T>
inline void block_values(const float* p, int64_t ld, const T* v, int64_t s_tok, int64_t n,
                         float* out) {
  constexpr int XT = value_tile(NV, G);
  for (int x0 = 0; x0 < NV; x0 += XT) {
    Vec acc[G][XT];
    for (int j = 0; j < G; ++j)
      for (int x = 0; x < XT; ++x) acc[j][x] = Vec::load(out + (j * NV + x0 + x) * W);
    const T* vt = v + x0 * W;
    for (int64_t o = 0; o < n; ++o, vt += s_tok) {
      Vec pj[G];
      for (int j = 0; j < G; ++j) pj[j] = Vec::set1(p[j * ld + o]);
      for (int x = 0; x < XT; ++x) {
        const Vec vx = tmvec::load_wide(vt + x * W);
        for (int j = 0; j < G; ++j) acc[j][x] = tmvec::fma(pj[j], vx, acc[j][x]);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int x = 0; x < XT; ++x) acc[j][x].store(out + (j * NV + x0 + x) * W);
  }
}

// Any head_dim d: W-lane chunks, then a scalar tail.
template <typename T>
inline void block_scores_any(const float* q, const T* k, int64_t s_tok, int64_t n, int64_t g,
                             int64_t d, float* s, int64_t ld) {
  for (int64_t o = 0; o < n; ++o, k += s_tok) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * d;
      // Four partial sums: one chain of d / W dependent FMAs waits on each (latency);
      // not over fp8 codes, whose widening keeps the core busy (measured 0.9x there).
      Vec a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
      int64_t x = 0;
      constexpr bool split = !std::is_same_v<T, c10::Float8_e4m3fn>;
      for (; split && x + 4 * W <= d; x += 4 * W) {
        a0 = tmvec::fma(Vec::load(qj + x), tmvec::load_wide(k + x), a0);
        a1 = tmvec::fma(Vec::load(qj + x + W), tmvec::load_wide(k + x + W), a1);
        a2 = tmvec::fma(Vec::load(qj + x + 2 * W), tmvec::load_wide(k + x + 2 * W), a2);
        a3 = tmvec::fma(Vec::load(qj + x + 3 * W), tmvec::load_wide(k + x + 3 * W), a3);
      }
      for (; x + W <= d; x += W)
        a0 = tmvec::fma(Vec::load(qj + x), tmvec::load_wide(k + x), a0);
      float sum = tmvec::reduce_add((a0 + a1) + (a2 + a3));
      for (; x < d; ++x) sum += qj[x] * static_cast<float>(k[x]);
      s[j * ld + o] = sum;
    }
  }
}

template <typename T>
inline void block_values_any(const float* p, int64_t ld, const T* v, int64_t s_tok, int64_t n,
                             int64_t g, int64_t d, float* out) {
  for (int64_t o = 0; o < n; ++o, v += s_tok) {
    int64_t x = 0;
    for (; x + W <= d; x += W) {
      const Vec vx = tmvec::load_wide(v + x);
      for (int64_t j = 0; j < g; ++j) {
        float* a = out + j * d + x;
        tmvec::fma(Vec::set1(p[j * ld + o]), vx, Vec::load(a)).store(a);
      }
    }
    for (; x < d; ++x)
      for (int64_t j = 0; j < g; ++j) out[j * d + x] += p[j * ld + o] * static_cast<float>(v[x]);
  }
}

// The g query heads of one kv head over one block, in sub-groups of 4, 2 or 1 heads
// (the compile-time kernels); NV = 0: the any-head_dim loops.
template <int NV, typename T>
inline void scores_of_group(const float* q, const T* k, int64_t s_tok, int64_t n, int64_t g,
                            int64_t d, float* s, int64_t ld) {
  if constexpr (NV == 0) {
    block_scores_any(q, k, s_tok, n, g, d, s, ld);
  } else {
    int64_t j = 0;
    for (; j + 4 <= g; j += 4) block_scores<NV, 4>(q + j * d, k, s_tok, n, s + j * ld, ld);
    if (j + 2 <= g) {
      block_scores<NV, 2>(q + j * d, k, s_tok, n, s + j * ld, ld);
      j += 2;
    }
    if (j < g) block_scores<NV, 1>(q + j * d, k, s_tok, n, s + j * ld, ld);
  }
}

template <int NV, typename T>
inline void values_of_group(const float* p, int64_t ld, const T* v, int64_t s_tok, int64_t n,
                            int64_t g, int64_t d, float* out) {
  if constexpr (NV == 0) {
    block_values_any(p, ld, v, s_tok, n, g, d, out);
  } else {
    int64_t j = 0;
    for (; j + 4 <= g; j += 4) block_values<NV, 4>(p + j * ld, ld, v, s_tok, n, out + j * d);
    if (j + 2 <= g) {
      block_values<NV, 2>(p + j * ld, ld, v, s_tok, n, out + j * d);
      j += 2;
    }
    if (j < g) block_values<NV, 1>(p + j * ld, ld, v, s_tok, n, out + j * d);
  }
}

// ---------------------------------------------------------------- softmax

// s[0..len) <- softmax(s), in fp32 (vec.h's exp: ~1e-7 relative error, as expf).
inline void softmax_row(float* s, int64_t len) {
  Vec vmax = Vec::set1(-INFINITY);
  int64_t t = 0;
  for (; t + W <= len; t += W) vmax = tmvec::max(vmax, Vec::load(s + t));
  float m = tmvec::reduce_max(vmax);
  for (; t < len; ++t) m = std::max(m, s[t]);
  const Vec mv = Vec::set1(m);
  Vec vsum = Vec::zero();
  for (t = 0; t + W <= len; t += W) {
    const Vec e = tmvec::exp(Vec::load(s + t) - mv);
    e.store(s + t);
    vsum = vsum + e;
  }
  if (t < len) {  // the tail: lanes past len are -inf, whose exp adds nothing
    float tail[W];
    std::fill(tail, tail + W, -INFINITY);
    std::memcpy(tail, s + t, sizeof(float) * (len - t));
    const Vec e = tmvec::exp(Vec::load(tail) - mv);
    e.store_n(s + t, static_cast<int>(len - t));
    vsum = vsum + e;
  }
  const float inv = 1.f / tmvec::reduce_add(vsum);
  const Vec iv = Vec::set1(inv);
  for (t = 0; t + W <= len; t += W) (Vec::load(s + t) * iv).store(s + t);
  for (; t < len; ++t) s[t] *= inv;
}

// ---------------------------------------------------------------- heads of one row

// Ask for the lines of heads [h0, h0 + nh) of n tokens from p (the same heads of
// the next block) while this block is computed: blocks are scattered, so the
// hardware prefetcher cannot guess the next one. Into L2: see attend_bf16.
template <typename T>
inline void prefetch_tokens(const T* p, int64_t n, int64_t s_tok, int64_t elems) {
  const auto* b = reinterpret_cast<const char*>(p);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < n; ++o, b += s_tok * static_cast<int64_t>(sizeof(T)))
    for (int64_t off = 0; off < bytes; off += 64) tmvec::prefetch_l2(b + off);
}

// n fp8 codes -> n fp32: the level's vector widening, the tail through the scalar one.
inline void widen_e4m3_row(const uint8_t* p, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + W <= n; i += W) tmvec::load_e4m3(p + i).store(dst + i);
  for (; i < n; ++i) dst[i] = tmvec::e4m3_to_float(p[i]);
}

// n tokens of d fp8 codes from p (token stride s_tok) -> dst [n, d] fp32.
inline void widen_tokens(const c10::Float8_e4m3fn* p, int64_t s_tok, int64_t n, int64_t d,
                         float* dst) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  for (int64_t o = 0; o < n; ++o, b += s_tok, dst += d) widen_e4m3_row(b, d, dst);
}

// Row r, kv heads [h0, h1), g query heads per kv head, head_dim d (= NV * W when
// NV > 0), over the row's tokens [first, len) (first > 0: a sliding window; the
// blocks before it are never read, they may have been given back): qf / out hold
// those heads' (h1 - h0) * g query / output rows (qf scaled).
// Blocks are walked once for all the heads: every head's K (then V) of a block is
// used while its lines are hot, and the next block's are prefetched.
// `staged` (an fp8 cache only; else null): room for a block of one head widened to
// fp32, which the products then read. The kernels widen each element once per group
// of 4 query heads (per head on the any-head_dim loops), and e4m3's widening costs
// more than the product: where heads share a kv head beyond that, the block is
// widened once instead (decode() says where).
template <int NV, typename T>
void attend(const float* qf, const Cache<T>& c, int64_t r, int64_t h0, int64_t h1, int64_t g,
            int64_t d, int64_t first, int64_t len, float softcap, float* scores, float* out,
            float* staged) {
  const int64_t nh = h1 - h0, nb = (len + c.bs - 1) / c.bs, span = len - first;
  for (int phase = 0; phase < 2; ++phase) {
    const bool value = phase == 1;
    if (value) {
      if (softcap > 0.f) {  // Gemma 2/3: scores become cap * tanh(scores / cap)
        const float inv = 1.f / softcap;
        for (int64_t i = 0; i < nh * g * span; ++i)
          scores[i] = softcap * std::tanh(scores[i] * inv);
      }
      for (int64_t i = 0; i < nh * g; ++i) softmax_row(scores + i * span, span);
      std::fill(out, out + nh * g * d, 0.f);
    }
    for (int64_t b = first / c.bs; b < nb; ++b) {
      const int64_t lo = std::max(b * c.bs, first), n = std::min((b + 1) * c.bs, len) - lo;
      const int64_t skip = lo - b * c.bs;
      // The next block of this phase (after the last: the first of V's), head by
      // head just before this block's same head is computed: one burst of every
      // head's lines filled the miss queue and stalled the core (attend_bf16).
      const bool last = b + 1 == nb;
      const int64_t pb = last ? first / c.bs : b + 1;
      const int64_t pn = std::min(c.bs, len - pb * c.bs);
      const bool ahead = !last || !value;
      for (int64_t i = 0; i < nh; ++i) {
        if (ahead)
          prefetch_tokens(c.at(r, pb, h0 + i, value || last), pn, c.s_tok,
                          i + 1 == nh ? d : c.s_head);
        const T* p = c.at(r, b, h0 + i, value) + skip * c.s_tok;
        float* s = scores + i * g * span + (lo - first);
        if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
          if (staged != nullptr) {
            widen_tokens(p, c.s_tok, n, d, staged);
            const float* f = staged;
            if (value) {
              values_of_group<NV>(s, span, f, d, n, g, d, out + i * g * d);
            } else {
              scores_of_group<NV>(qf + i * g * d, f, d, n, g, d, s, span);
            }
            continue;
          }
        }
        if (value) {
          values_of_group<NV>(s, span, p, c.s_tok, n, g, d, out + i * g * d);
        } else {
          scores_of_group<NV>(qf + i * g * d, p, c.s_tok, n, g, d, s, span);
        }
      }
    }
  }
}

// The head sizes with a compile-time kernel (Qwen3.5 / Qwen3-Next and Gemma take 256):
// 256 only where a K row fits in half the registers (AVX-512's 16 vectors of 16); with
// 8 or 4 lanes its rows spill and the any-head_dim loops run it faster.
constexpr bool kFixed256 = 2 * (256 / W) <= Vec::kRegs;
inline bool fixed_head_dim(int64_t d) { return d == 64 || d == 128 || (kFixed256 && d == 256); }

template <typename T>
void attend_any_d(const float* qf, const Cache<T>& c, int64_t r, int64_t h0, int64_t h1,
                  int64_t g, int64_t d, int64_t first, int64_t len, float softcap,
                  float* scores, float* out, float* staged) {
  if (d == 64)
    return attend<64 / W>(qf, c, r, h0, h1, g, d, first, len, softcap, scores, out, staged);
  if (d == 128)
    return attend<128 / W>(qf, c, r, h0, h1, g, d, first, len, softcap, scores, out, staged);
  if constexpr (kFixed256) {
    if (d == 256)
      return attend<256 / W>(qf, c, r, h0, h1, g, d, first, len, softcap, scores, out, staged);
  }
  attend<0>(qf, c, r, h0, h1, g, d, first, len, softcap, scores, out, staged);
}

// ---------------------------------------------------------------- vdpbf16ps (avx512_bf16)
// bf16 queries over a bf16 cache at a level with AVX512-BF16 take both products on
// vdpbf16ps (fp32 sums of bf16 pair products) instead of widening every K/V element:
// q . k pairs adjacent head-dim elements, which is how both rows are stored (no
// shuffle: the K row is the instruction's operand as loaded), and the products of two
// bf16 are exact in fp32, summed in fp32 as the widened path does (the scale multiplies
// the sums). p . v pairs adjacent tokens: two V rows interleaved (unpack within 128-bit
// lanes; the accumulators keep that lane order and are put back in order once per row)
// against the weights rounded to bf16 (RNE: relative error <= 2^-8 each), so an output
// moves by at most 2^-8 * sum_t p_t |v_t| (<= 2^-8 max |v|) beyond the widened path's
// error, the bound of paged_prefill's bf16 path. Head sizes that are a multiple of 32
// (one 512-bit register of bf16) take it; others, and fp32 / fp16 / fp8 caches, keep
// the widening path (fp32 models keep their exact fp32 products).
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
constexpr int kChunk = 32;  // tokens per step (16 pairs; one rounding of 32 weights)
using bf16 = c10::BFloat16;

// s[j * ld + t] = scale * q_j . k_t for G query heads (bf16 rows of d, d apart) and the
// TT (4 or 1) keys rows[t] + off.
template <int G, int TT>
inline void scores_bf16(const bf16* q, int64_t d, const bf16* const* rows, int64_t off,
                        float scale, float* s, int64_t ld) {
  __m512 acc[G][TT];
  for (int j = 0; j < G; ++j)
    for (int t = 0; t < TT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int64_t x = 0; x < d; x += 32) {
    __m512bh k[TT];
    for (int t = 0; t < TT; ++t) k[t] = (__m512bh)_mm512_loadu_si512(rows[t] + off + x);
    for (int j = 0; j < G; ++j) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + j * d + x);
      for (int t = 0; t < TT; ++t) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], qv, k[t]);
    }
  }
  for (int j = 0; j < G; ++j) {
    if constexpr (TT == 4) {
      const __m128 r = tmvec::reduce_add4_ps(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
      _mm_storeu_ps(s + j * ld, _mm_mul_ps(r, _mm_set1_ps(scale)));
    } else {
      s[j * ld] = scale * _mm512_reduce_add_ps(acc[j][0]);
    }
  }
}

template <int G>
inline void scores_rows_bf16(const bf16* q, int64_t d, const bf16* const* rows, int64_t off,
                             int n, float scale, float* s, int64_t ld) {
  int t = 0;
  for (; t + 4 <= n; t += 4) scores_bf16<G, 4>(q, d, rows + t, off, scale, s + t, ld);
  for (; t < n; ++t) scores_bf16<G, 1>(q, d, rows + t, off, scale, s + t, ld);
}

// out_j's chunks [x0, x0 + XT) of 32 (fp32, pair lane order) += sum over the pairs u of
// p2_j[u] . (v_{2u}, v_{2u+1}): rows[2u] + off and rows[2u + 1] + off, bf16 rows.
template <int G, int XT>
inline void values_bf16(const uint32_t* p2, int64_t ldp, const bf16* const* rows, int64_t off,
                        int npairs, int64_t x0, float* out, int64_t d) {
  __m512 acc[G][2 * XT];
  for (int j = 0; j < G; ++j)
    for (int x = 0; x < 2 * XT; ++x) acc[j][x] = _mm512_loadu_ps(out + j * d + x0 * 32 + x * 16);
  for (int u = 0; u < npairs; ++u) {
    __m512bh pv[G];
    for (int j = 0; j < G; ++j)
      pv[j] = (__m512bh)_mm512_set1_epi32(static_cast<int>(p2[j * ldp + u]));
    const bf16* a = rows[2 * u] + off + x0 * 32;
    const bf16* b = rows[2 * u + 1] + off + x0 * 32;
    for (int x = 0; x < XT; ++x) {
      const __m512i va = _mm512_loadu_si512(a + x * 32), vb = _mm512_loadu_si512(b + x * 32);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(va, vb);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(va, vb);
      for (int j = 0; j < G; ++j) {
        acc[j][2 * x] = _mm512_dpbf16_ps(acc[j][2 * x], pv[j], lo);
        acc[j][2 * x + 1] = _mm512_dpbf16_ps(acc[j][2 * x + 1], pv[j], hi);
      }
    }
  }
  for (int j = 0; j < G; ++j)
    for (int x = 0; x < 2 * XT; ++x) _mm512_storeu_ps(out + j * d + x0 * 32 + x * 16, acc[j][x]);
}

template <int G>
inline void values_rows_bf16(const uint32_t* p2, int64_t ldp, const bf16* const* rows,
                             int64_t off, int npairs, float* out, int64_t d) {
  const int64_t nv = d / 32;
  constexpr int XT = G >= 4 ? 2 : 4;  // 2 * G * XT accumulators: 16 registers
  int64_t x0 = 0;
  for (; x0 + XT <= nv; x0 += XT) values_bf16<G, XT>(p2, ldp, rows, off, npairs, x0, out, d);
  for (; x0 < nv; ++x0) values_bf16<G, 1>(p2, ldp, rows, off, npairs, x0, out, d);
}

// A row of d floats in pair lane order (per 32: the low 16 lanes hold elements 0-3,
// 8-11, 16-19, 24-27, the high ones 4-7, 12-15, ...) narrowed to bf16 in order.
inline void unpair_row(const float* src, int64_t d, bf16* dst) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                           29, 30, 31);
  for (int64_t x = 0; x < d; x += 32) {
    const __m512 lo = _mm512_loadu_ps(src + x), hi = _mm512_loadu_ps(src + x + 16);
    Vec(_mm512_permutex2var_ps(lo, first, hi)).store(dst + x);
    Vec(_mm512_permutex2var_ps(lo, second, hi)).store(dst + x + 16);
  }
}

// Per-thread scratch of the pair path.
struct PairScratch {
  std::vector<float> scores, out;
  std::vector<uint32_t> p2;
  std::vector<bf16> zeros;  // the partner row of an odd count's last token
};

// Row r's kv heads [h0, h1) (g query heads each, head_dim d a multiple of 32) over
// its tokens [first, len), as attend() but on vdpbf16ps: q / o hold those heads'
// (h1 - h0) * g bf16 query / output rows. Tokens go in chunks of kChunk, whose row
// pointers (head h0 of each token) are looked up once; the next chunk is prefetched.
// `then`: the job this thread runs next (row < 0: none), whose first chunk of K is
// prefetched during this job's last chunk of V (as V's first chunk is during K's last):
// unprefetched, a chunk's 32 token rows are demand misses with little in flight.
struct NextJob {
  int64_t row = -1, h0 = 0, first = 0, len = 0;
};
inline void attend_bf16(const bf16* q, const Cache<bf16>& c, int64_t r, int64_t h0, int64_t h1,
                        int64_t g, int64_t d, int64_t first, int64_t len, float scale,
                        float softcap, PairScratch& w, bf16* o, NextJob then) {
  const int64_t nh = h1 - h0, span = len - first, rows = nh * g;
  const int64_t sp = (span + kChunk - 1) / kChunk * kChunk;  // a row of scores, padded
  const int64_t head_elems = (nh - 1) * c.s_head + d;
  w.scores.resize(rows * sp);
  w.p2.resize(rows * sp / 2);
  w.out.assign(rows * d, 0.f);
  if (static_cast<int64_t>(w.zeros.size()) < head_elems) w.zeros.assign(head_elems, bf16(0.f));
  const bf16 *cur[kChunk], *next[kChunk];
  // Row pointers (head hh of each token) of row rr's chunk at c0 (of rr's rlen tokens).
  auto lookup_in = [&](int64_t rr, int64_t hh, int64_t rlen, int64_t c0, bool value,
                       const bf16** ptr) {
    const int64_t n = std::min<int64_t>(kChunk, rlen - c0);
    // Walk the blocks: one division a chunk, not one a token (a 64-bit division
    // costs more than a token's products at d 64).
    int64_t b = c0 / c.bs, o = c0 - b * c.bs;
    const bf16* base = c.at(rr, b, hh, value);
    for (int64_t t = 0; t < n; ++t) {
      ptr[t] = base + o * c.s_tok;
      if (++o == c.bs && t + 1 < n) {
        o = 0;
        base = c.at(rr, ++b, hh, value);
      }
    }
    for (int64_t t = n; t < kChunk; ++t) ptr[t] = w.zeros.data();
    return static_cast<int>(n);
  };
  auto lookup = [&](int64_t c0, bool value, const bf16** ptr) {
    return lookup_in(r, h0, len, c0, value, ptr);
  };
  // The chunk after [c0, c0 + kChunk) of this phase: its next chunk, else the first
  // of the V phase, else the next job's first of K (0: none).
  auto lookup_after = [&](int64_t c0, bool value, const bf16** ptr) {
    if (c0 + kChunk < len) return lookup(c0 + kChunk, value, ptr);
    if (!value) return lookup(first, true, ptr);
    if (then.row >= 0 && then.first < then.len)
      return lookup_in(then.row, then.h0, then.len, then.first, false, ptr);
    return 0;
  };
  // Into L2 (not L1): a burst of L1 prefetches stalls on the few L1 miss buffers,
  // while L2 holds more misses in flight (measured: 1.3-1.5x the K/V read rate).
  // Head by head, each just before that head of the current chunk is computed: one
  // burst of every head's lines (8 lines a token at 4 kv heads of 64) filled the
  // miss queue and stalled the core on the prefetches themselves, so memory and
  // arithmetic took turns (batched rows read ~15 GB/s of 35).
  auto prefetch = [&](const bf16* const* ptr, int n, int64_t lo, int64_t hi) {
    for (int t = 0; t < n; ++t) {
      const auto* b = reinterpret_cast<const char*>(ptr[t]);
      for (int64_t off = lo * 2 / 64 * 64; off < hi * 2; off += 64) tmvec::prefetch_l2(b + off);
    }
  };
  for (int phase = 0; phase < 2; ++phase) {
    const bool value = phase == 1;
    if (value) {
      for (int64_t i = 0; i < rows; ++i) {
        float* s = w.scores.data() + i * sp;
        if (softcap > 0.f) {  // Gemma 2/3: scores become cap * tanh(scores / cap)
          const float inv = 1.f / softcap;
          for (int64_t t = 0; t < span; ++t) s[t] = softcap * std::tanh(s[t] * inv);
        }
        softmax_row(s, span);
        std::fill(s + span, s + sp, 0.f);  // padding tokens weigh nothing
        uint32_t* p2 = w.p2.data() + i * sp / 2;
        for (int64_t t = 0; t < sp; t += 32) {
          const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t));
          _mm512_storeu_si512(p2 + t / 2, (__m512i)b);
        }
      }
    }
    int n = lookup(first, value, cur);
    for (int64_t c0 = first; c0 < len; c0 += kChunk) {
      const int n1 = lookup_after(c0, value, next);
      const int64_t col = c0 - first;
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t off = i * c.s_head;
        prefetch(next, n1, off, i + 1 == nh ? head_elems : off + c.s_head);
        for (int64_t j = 0; j < g;) {
          const int64_t row = i * g + j, left = g - j;
          const int G = left >= 4 ? 4 : left >= 2 ? 2 : 1;
          if (value) {
            const uint32_t* p2 = w.p2.data() + row * sp / 2 + col / 2;
            float* out = w.out.data() + row * d;
            const int np = (n + 1) / 2;
            if (G == 4) values_rows_bf16<4>(p2, sp / 2, cur, off, np, out, d);
            else if (G == 2) values_rows_bf16<2>(p2, sp / 2, cur, off, np, out, d);
            else values_rows_bf16<1>(p2, sp / 2, cur, off, np, out, d);
          } else {
            const bf16* qj = q + row * d;
            float* s = w.scores.data() + row * sp + col;
            if (G == 4) scores_rows_bf16<4>(qj, d, cur, off, n, scale, s, sp);
            else if (G == 2) scores_rows_bf16<2>(qj, d, cur, off, n, scale, s, sp);
            else scores_rows_bf16<1>(qj, d, cur, off, n, scale, s, sp);
          }
          j += G;
        }
      }
      std::copy(next, next + kChunk, cur);
      n = n1;
    }
  }
  for (int64_t i = 0; i < rows; ++i) unpair_row(w.out.data() + i * d, d, o + i * d);
}
#else
constexpr bool kHasBf16Dot = false;
struct PairScratch {};
#endif

// dst[i] = src[i] * scale in fp32, and back (rounded as a c10 cast rounds).
template <typename T>
inline void widen_scaled(const T* src, float* dst, int64_t n, float scale) {
  const Vec sv = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::load(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}
template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// q / out of the model's dtype T, the cache of C (T, or float8_e4m3fn). `scale` already
// holds an fp8 cache's k_scale (q . (k_scale k) = (k_scale q) . k); v_scale != 1
// multiplies each output row once, after the weighted sum of the stored V.
template <typename T, typename C>
void decode(const T* q, const Cache<C>& c, const int32_t* seq_lens, T* out, int64_t nd,
            int64_t hq, int64_t hkv, int64_t d, float scale, int64_t window, float softcap,
            float v_scale) {
  const int64_t g = hq / hkv;
  // Enough rows to keep every thread busy: one job per row, all its heads (each
  // block visited once); else one per (row, kv head). The results are the same.
  const int64_t heads = nd >= 4 * at::get_num_threads() ? hkv : 1;
  const int64_t jobs_per_row = hkv / heads, width = heads * g * d;
  // bf16 queries over a bf16 cache: vdpbf16ps where the level has it (see above).
  constexpr bool pairs_type = kHasBf16Dot && std::is_same_v<T, c10::BFloat16> &&
                              std::is_same_v<C, c10::BFloat16>;
  const bool pairs = pairs_type && d % 32 == 0;
  // An fp8 cache's blocks widened once where the kernels would widen them repeatedly:
  // per head on the any-head_dim loops; per group of 4 heads on the fixed ones, where
  // that measured faster only with AVX-512 (d128 GQA 8: 1.08x; 0.87x with AVX2).
  const bool stage = std::is_same_v<C, c10::Float8_e4m3fn> &&
                     (fixed_head_dim(d) ? g > 4 && W == 16 : g > 1);
  tmpar::parallel_for(0, nd * jobs_per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(pairs ? 0 : width), acc(pairs ? 0 : width), scores;
    std::vector<float> staged(stage ? c.bs * d : 0);
    PairScratch pw;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / jobs_per_row, h0 = job % jobs_per_row * heads;
      const int64_t len = seq_lens[r];
      // A sliding window sees the last `window` positions, its own included.
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t q_off = (r * hq + h0 * g) * d;
      if constexpr (pairs_type) {
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
        if (pairs) {
          NextJob then;
          if (job + 1 < end) {
            then.row = (job + 1) / jobs_per_row;
            then.h0 = (job + 1) % jobs_per_row * heads;
            then.len = seq_lens[then.row];
            then.first = window > 0 ? std::max<int64_t>(0, then.len - window) : 0;
          }
          attend_bf16(q + q_off, c, r, h0, h0 + heads, g, d, first, len, scale, softcap, pw,
                      out + q_off, then);
          continue;
        }
#endif
      }
      scores.resize(heads * g * (len - first));
      widen_scaled(q + q_off, qf.data(), width, scale);
      attend_any_d(qf.data(), c, r, h0, h0 + heads, g, d, first, len, softcap, scores.data(),
                   acc.data(), stage ? staged.data() : nullptr);
      if (v_scale != 1.f)
        for (int64_t i = 0; i < width; ++i) acc[i] *= v_scale;
      narrow(acc.data(), out + q_off, width);
    }
  });
}

}  // namespace

// q [nd, Hq, D]; kv [num_blocks, 2, bs, Hkv, D] (dim 0 may be padded);
// block_table [nd, max_nb] int32; seq_lens [nd] int32 -> out [nd, Hq, D].
// window > 0: row r attends its last `window` positions only (a sliding window);
// softcap > 0: scores (scaled) become softcap * tanh(score / softcap) before the softmax;
// k_scale / v_scale: a float8_e4m3fn cache's per-layer scales (values = codes x scale).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale, int64_t window,
                           double softcap, double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [nd, Hq, D] tensor");
  TORCH_CHECK(kv.dim() == 5 && kv.stride(4) == 1 && kv.stride(3) == kv.size(4),
              "kv cache must be [num_blocks, 2, block_size, Hkv, D] with contiguous heads");
  const bool fp8 = kv.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || kv.scalar_type() == q.scalar_type(),
              "q and kv cache dtypes differ (the cache may be float8_e4m3fn)");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous());
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "paged_decode: k_scale / v_scale must be finite and positive");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "paged_decode: k_scale / v_scale apply to a float8_e4m3fn cache only");
  auto out = torch::empty_like(q);
  auto run = [&](auto q_tag, auto cache_tag) {
    using T = decltype(q_tag);
    using C = decltype(cache_tag);
    Cache<C> c{reinterpret_cast<const C*>(kv.data_ptr()), block_table.data_ptr<int32_t>(),
               block_table.size(1), kv.size(2), kv.stride(0), kv.stride(1), kv.stride(2),
               kv.stride(3)};
    decode<T, C>(reinterpret_cast<const T*>(q.data_ptr()), c, seq_lens.data_ptr<int32_t>(),
                 reinterpret_cast<T*>(out.data_ptr()), q.size(0), q.size(1), kv.size(3),
                 q.size(2), static_cast<float>(scale * k_scale), window,
                 static_cast<float>(softcap), static_cast<float>(v_scale));
  };
  auto with_cache = [&](auto q_tag) {
    if (fp8) {
      run(q_tag, c10::Float8_e4m3fn{});
    } else {
      run(q_tag, q_tag);
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: with_cache(float{}); break;
    case at::kBFloat16: with_cache(c10::BFloat16{}); break;
    case at::kHalf: with_cache(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// codes [n] uint8 (float8_e4m3fn bits) -> [n] fp32 through the vector widening of this
// level (vec_fp8.h), the tail through the scalar one: what the decode kernel reads.
torch::Tensor widen_e4m3(torch::Tensor codes) {
  TORCH_CHECK(codes.dim() == 1 && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kByte || codes.scalar_type() == at::kFloat8_e4m3fn),
              "widen_e4m3: codes must be a contiguous 1-d uint8 / float8_e4m3fn tensor");
  auto out = torch::empty({codes.size(0)}, codes.options().dtype(at::kFloat));
  widen_e4m3_row(static_cast<const uint8_t*>(codes.data_ptr()), codes.size(0),
                 out.data_ptr<float>());
  return out;
}
