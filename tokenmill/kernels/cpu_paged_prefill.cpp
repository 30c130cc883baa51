// Flash-style prefill attention for CPU over the paged KV cache: every prompt chunk of
// a step (ragged: query_start_loc / seq_lens, each chunk after its cached prefix) in
// one call, K/V read from the cache blocks through the block table (no gather copy).
//
// A job is (chunk, kv head, query tile): the tile's queries of all g query heads of
// that kv head (token-major rows, so each K/V tile is read once for the g heads) walk
// the keys they can see in tiles of kBK tokens, with an online softmax (running max
// and sum per row, fp32). Each K tile is widened to fp32 and transposed ([D][kBK]) and
// each V tile widened ([kBK][Dp]) once per job, so the two inner products are
// register-tiled fp32 GEMMs (kR query rows x kNK key vectors, kR rows x kXT head-dim
// vectors) whatever the cache's element type (fp32, bf16, fp16, float8_e4m3fn) or the
// head size. Causal and sliding-window masks are applied per row; keys before the
// first one a tile can see (a window's given-back blocks) and past the chunk's end are
// never read. Written once against vec.h's Vec: every capability level runs it.
//
// At a level with AVX512-BF16 (avx512_bf16), bf16 queries over a bf16 cache take both
// products on vdpbf16ps instead (fp32 sums of bf16 pair products): the K tile is laid
// out [D/2][kBK] in pairs of adjacent head-dim elements, the V tile [kBK/2][Dp] in
// pairs of adjacent keys. Q.K^T: the products of two bf16 are exact in fp32 and summed
// in fp32, as the widened path does (the scale is applied to the sums, not to q). P.V:
// the softmax weights are rounded to bf16 (RNE, 8 significant bits: relative error
// <= 2^-8 each; the running sum l keeps the fp32 weights), so an output moves by at most
// 2^-8 * sum_j p_j |v_j| / l (<= 2^-8 max |v|) beyond the widened path's error, as
// flash attention on GPUs rounds P for its P.V product.
//
// At the amx level, head sizes a multiple of 32 take the same two products on AMX tiles
// (TDPBF16PS) over the same pair layouts, 16 query rows at a time: Q.K^T as [16 rows x
// 16 pairs] x [16 pairs x 16 keys] tiles, P.V as [16 rows x 16 key pairs] x [16 key
// pairs x 16 head-dim columns] accumulated onto O (rescaled by alpha first); the same
// exact products and fp32 sums, in another order. The softmax is the same code.
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "vec.h"
#include "vec_fp8.h"

namespace {

using tmvec::Vec;
constexpr int W = Vec::W;
constexpr int kBK = 64;                         // keys per tile
constexpr int kR = 6;                           // query rows per register tile
constexpr int kNK = Vec::kRegs >= 32 ? 4 : 2;   // key vectors per register tile (scores)
constexpr int kXT = Vec::kRegs >= 32 ? 4 : 2;   // head-dim vectors per register tile (values)
constexpr int kTileRows = 120;                  // query rows (tokens x g heads) per job, about
// On AMX tiles a job packs each key tile (K transposed to pair words, V interleaved)
// for its own rows, and the tiles' products are fast enough that the packing at 120
// rows was a third of the time: there jobs grow to up to kTileRowsTiles rows while
// every thread keeps >= 4 of them (python -m tokenmill.bench.cpu_prefill --tokens 2000
// --head-size 128, 16 / 8 heads, 2 threads on the AMX Xeon: 52 -> 32 ms).
constexpr int kTileRowsTiles = 960;
constexpr int kTR = 16;                         // query rows per group on AMX tiles
constexpr int kKeyGroup = kNK * W;
static_assert(kBK % kKeyGroup == 0, "a key tile is whole register tiles");

// s[i][c) = sum_d q[i][d] * kt[d][c) for kR rows i and key columns [0, cols) (cols a
// multiple of kKeyGroup): q broadcast a scalar at a time, kt's rows are kBK keys wide.
inline void scores_rows(const float* q, int64_t ldq, const float* kt, int64_t d_len, int cols,
                        float* s) {
  for (int c0 = 0; c0 < cols; c0 += kKeyGroup) {
    Vec acc[kR][kNK];
    for (int i = 0; i < kR; ++i)
      for (int x = 0; x < kNK; ++x) acc[i][x] = Vec::zero();
    const float* k = kt + c0;
    for (int64_t d = 0; d < d_len; ++d, k += kBK) {
      Vec kv[kNK];
      for (int x = 0; x < kNK; ++x) kv[x] = Vec::load(k + x * W);
      for (int i = 0; i < kR; ++i) {
        const Vec qi = Vec::set1(q[i * ldq + d]);
        for (int x = 0; x < kNK; ++x) acc[i][x] = tmvec::fma(qi, kv[x], acc[i][x]);
      }
    }
    for (int i = 0; i < kR; ++i)
      for (int x = 0; x < kNK; ++x) acc[i][x].store(s + i * kBK + c0 + x * W);
  }
}

// o[i][x0*W, (x0+XT)*W) = o * alpha[i] + sum_{t<n} p[i][t] * v[t][...] for kR rows i.
template <int XT>
inline void values_rows(const float* p, const float* alpha, const float* v, int64_t ldv,
                        int64_t n, float* o, int64_t ldo, int64_t x0) {
  Vec acc[kR][XT];
  for (int i = 0; i < kR; ++i) {
    const Vec a = Vec::set1(alpha[i]);
    for (int x = 0; x < XT; ++x) acc[i][x] = Vec::load(o + i * ldo + (x0 + x) * W) * a;
  }
  const float* vt = v + x0 * W;
  for (int64_t t = 0; t < n; ++t, vt += ldv) {
    Vec vx[XT];
    for (int x = 0; x < XT; ++x) vx[x] = Vec::load(vt + x * W);
    for (int i = 0; i < kR; ++i) {
      const Vec pi = Vec::set1(p[i * kBK + t]);
      for (int x = 0; x < XT; ++x) acc[i][x] = tmvec::fma(pi, vx[x], acc[i][x]);
    }
  }
  for (int i = 0; i < kR; ++i)
    for (int x = 0; x < XT; ++x) acc[i][x].store(o + i * ldo + (x0 + x) * W);
}

inline void values_all(const float* p, const float* alpha, const float* v, int64_t ldv,
                       int64_t n, float* o, int64_t nvec) {
  int64_t x0 = 0;
  for (; x0 + kXT <= nvec; x0 += kXT) values_rows<kXT>(p, alpha, v, ldv, n, o, ldv, x0);
  if constexpr (kXT > 2) {
    if (x0 + 2 <= nvec) {
      values_rows<2>(p, alpha, v, ldv, n, o, ldv, x0);
      x0 += 2;
    }
  }
  if (x0 < nvec) values_rows<1>(p, alpha, v, ldv, n, o, ldv, x0);
}

// n elements of a cache row (or a query row) widened to fp32, times scale.
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n, float scale) {
  const Vec sv = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) (tmvec::load_wide(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

template <typename T>
inline void narrow_row(const float* src, float scale, T* dst, int64_t n) {
  const Vec sv = Vec::set1(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::load(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

struct Job {
  int64_t chunk, head, t0, t1, cost;
};

struct Shape {
  int64_t hq, hkv, g, d, dp;     // heads, kv heads, heads per kv head, head size, padded
  int64_t q_tok, q_head;         // q strides (elements)
  int64_t bs, max_nb, s_block, s_kv, s_tok, s_head;  // cache geometry (elements)
  float scale, softcap;
  int64_t window;
};

// Per-thread scratch: the tile's queries, scores, outputs and one K / V tile (fp32
// widened, or bf16 pairs: `pairs`).
// 64-byte aligned (the AMX tiles read and write them: tmamx::Aligned64).
template <typename T>
using Buffer = std::vector<T, tmamx::Aligned64<T>>;

struct Scratch {
  Buffer<float> q, s, o, kt, v, row, m, l, alpha;
  // bf16 pairs as 32-bit words: queries [mp][D/2], K [D/2][kBK], V [kBK/2][Dp], and
  // the rounded weights [mp][kBK/2] (D/2 rounded up: an odd D's last pair is (x, 0)).
  Buffer<uint32_t> q2, k2, v2, p2;
  Scratch(const Shape& sh, int64_t rows, bool pairs) {
    // rows padded to whole register tiles (kR) or tile groups (kTR)
    const int64_t mp = std::max((rows + kR - 1) / kR * kR, (rows + kTR - 1) / kTR * kTR);
    s.assign(mp * kBK, 0.f);
    o.assign(mp * sh.dp, 0.f);
    m.assign(mp, 0.f);
    l.assign(mp, 0.f);
    alpha.assign(mp, 1.f);
    if (pairs) {
      const int64_t dh = (sh.d + 1) / 2;
      q2.assign(mp * dh, 0u);
      k2.assign(dh * kBK, 0u);
      v2.assign(kBK / 2 * sh.dp, 0u);
      p2.assign(mp * kBK / 2, 0u);
    } else {
      q.assign(mp * sh.d, 0.f);
      kt.assign(sh.d * kBK, 0.f);
      v.assign(kBK * sh.dp, 0.f);
      row.assign(sh.dp, 0.f);
    }
  }
};

#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;

inline uint16_t bf16_bits(const c10::BFloat16& x) { return x.x; }

// One query (or key) row of d bf16 as d/2 pair words (an odd d's last word is (x, 0)).
inline void pair_row(const c10::BFloat16* src, int64_t d, uint32_t* dst) {
  const int64_t whole = d / 2;
  std::memcpy(dst, src, whole * sizeof(uint32_t));
  if (d & 1) dst[whole] = bf16_bits(src[d - 1]);
}

// Two value rows a, b (adjacent keys) interleaved: dst[x] = (a[x], b[x]) for x < d; b
// null: (a[x], 0). Columns [d, Dp) are never written (they stay zero).
inline void interleave_rows(const c10::BFloat16* a, const c10::BFloat16* b, int64_t d,
                            uint32_t* dst) {
  for (int64_t x = 0; x < d; x += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, d - x));
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, a + x));
    const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, b + x))
                         : _mm512_setzero_si512();
    _mm512_mask_storeu_epi32(dst + x, mask, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// dst[c * ld + i] = rows[i][c] for 16 rows of 16 32-bit words (a key's pair words p ..
// p + 15 to the k2 layout, 16 keys at once): in registers, where a word at a time made
// the packing of a key tile cost about what its products do on AMX tiles.
inline void transpose_words16(const uint32_t* const* rows, uint32_t* dst, int64_t ld) {
  __m512i r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  for (int i = 0; i < 16; i += 2) {  // 128-bit lane k: words 4k .. 4k + 3 of rows i, i + 1
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], lane k: word 4k + c of rows g .. g + 3
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane k of the four row groups: word 4k + c
    const __m512i even01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);   // lanes 0, 2
    const __m512i odd01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);    // lanes 1, 3
    const __m512i even23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    _mm512_storeu_si512(dst + c * ld, _mm512_shuffle_i32x4(even01, even23, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * ld, _mm512_shuffle_i32x4(odd01, odd23, 0x88));
    _mm512_storeu_si512(dst + (8 + c) * ld, _mm512_shuffle_i32x4(even01, even23, 0xdd));
    _mm512_storeu_si512(dst + (12 + c) * ld, _mm512_shuffle_i32x4(odd01, odd23, 0xdd));
  }
}

// s[i][c) = scale * sum_p q2[i][p] . k2[p][c) for kR rows i and key columns [0, cols).
inline void scores_rows_bf16(const uint32_t* q2, int64_t dh, const uint32_t* k2, int cols,
                             float scale, float* s) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int c0 = 0; c0 < cols; c0 += 64) {
    __m512 acc[kR][4];
    for (int i = 0; i < kR; ++i)
      for (int x = 0; x < 4; ++x) acc[i][x] = _mm512_setzero_ps();
    const uint32_t* k = k2 + c0;
    for (int64_t p = 0; p < dh; ++p, k += kBK) {
      __m512bh kv[4];
      for (int x = 0; x < 4; ++x) kv[x] = (__m512bh)_mm512_loadu_si512(k + x * 16);
      for (int i = 0; i < kR; ++i) {
        const __m512bh qi = (__m512bh)_mm512_set1_epi32(static_cast<int>(q2[i * dh + p]));
        for (int x = 0; x < 4; ++x) acc[i][x] = _mm512_dpbf16_ps(acc[i][x], qi, kv[x]);
      }
    }
    for (int i = 0; i < kR; ++i)
      for (int x = 0; x < 4; ++x)
        _mm512_storeu_ps(s + i * kBK + c0 + x * 16, _mm512_mul_ps(acc[i][x], sv));
  }
}

// o[i][x0*16, (x0+XT)*16) = o * alpha[i] + sum_{u<npairs} p2[i][u] . v2[u][...].
template <int XT>
inline void values_rows_bf16(const uint32_t* p2, const float* alpha, const uint32_t* v2,
                             int64_t dp, int64_t npairs, float* o, int64_t x0) {
  __m512 acc[kR][XT];
  for (int i = 0; i < kR; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int x = 0; x < XT; ++x)
      acc[i][x] = _mm512_mul_ps(_mm512_loadu_ps(o + i * dp + (x0 + x) * 16), a);
  }
  const uint32_t* vt = v2 + x0 * 16;
  for (int64_t u = 0; u < npairs; ++u, vt += dp) {
    __m512bh vx[XT];
    for (int x = 0; x < XT; ++x) vx[x] = (__m512bh)_mm512_loadu_si512(vt + x * 16);
    for (int i = 0; i < kR; ++i) {
      const __m512bh pi = (__m512bh)_mm512_set1_epi32(static_cast<int>(p2[i * (kBK / 2) + u]));
      for (int x = 0; x < XT; ++x) acc[i][x] = _mm512_dpbf16_ps(acc[i][x], pi, vx[x]);
    }
  }
  for (int i = 0; i < kR; ++i)
    for (int x = 0; x < XT; ++x) _mm512_storeu_ps(o + i * dp + (x0 + x) * 16, acc[i][x]);
}

inline void values_all_bf16(const uint32_t* p2, const float* alpha, const uint32_t* v2,
                            int64_t dp, int64_t npairs, float* o) {
  const int64_t nvec = dp / 16;
  int64_t x0 = 0;
  for (; x0 + 4 <= nvec; x0 += 4) values_rows_bf16<4>(p2, alpha, v2, dp, npairs, o, x0);
  if (x0 + 2 <= nvec) {
    values_rows_bf16<2>(p2, alpha, v2, dp, npairs, o, x0);
    x0 += 2;
  }
  if (x0 < nvec) values_rows_bf16<1>(p2, alpha, v2, dp, npairs, o, x0);
}

// A row's weights [0, cols) (cols a multiple of 32) rounded to bf16 (RNE) in key pairs.
inline void round_weights(const float* si, int cols, uint32_t* dst) {
  for (int c = 0; c < cols; c += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(si + c + 16), _mm512_loadu_ps(si + c));
    _mm512_storeu_si512(dst + c / 2, (__m512i)b);
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool kHasTiles = true;

// s[i][0, kBK) = scale * sum_p q2[i][p] . k2[p][...] for kTR rows i (q2 rows dh words
// apart, dh a multiple of 16): one C tile per 16 keys, 16 pairs a step. Head sizes up
// to 128 (kSteps = dh / 16 of 2 or 4) keep the query tiles loaded across the key
// columns and fill two C tiles at a time; the sums are the same, in the same order.
template <int kSteps>
inline void scores_tiles_held(const uint32_t* q2, int64_t dh, const uint32_t* k2,
                              float* s) {
  static_assert(kSteps == 2 || kSteps == 4, "two or four query tiles (tiles 2 .. 5)");
  _tile_loadd(2, q2, dh * 4);
  _tile_loadd(3, q2 + 16, dh * 4);
  if constexpr (kSteps == 4) {
    _tile_loadd(4, q2 + 32, dh * 4);
    _tile_loadd(5, q2 + 48, dh * 4);
  }
  for (int c = 0; c < kBK / 16; c += 2) {
    const uint32_t* k = k2 + 16 * c;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, k, kBK * 4);
    _tile_dpbf16ps(0, 2, 6);
    _tile_loadd(7, k + 16, kBK * 4);
    _tile_dpbf16ps(1, 2, 7);
    _tile_loadd(6, k + 16 * kBK, kBK * 4);
    _tile_dpbf16ps(0, 3, 6);
    _tile_loadd(7, k + 16 * kBK + 16, kBK * 4);
    _tile_dpbf16ps(1, 3, 7);
    if constexpr (kSteps == 4) {
      _tile_loadd(6, k + 32 * kBK, kBK * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, k + 32 * kBK + 16, kBK * 4);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, k + 48 * kBK, kBK * 4);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, k + 48 * kBK + 16, kBK * 4);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, s + 16 * c, kBK * 4);
    _tile_stored(1, s + 16 * c + 16, kBK * 4);
  }
}

inline void scores_tiles(const uint32_t* q2, int64_t dh, const uint32_t* k2, float scale,
                         float* s) {
  if (dh == 32) {
    scores_tiles_held<2>(q2, dh, k2, s);
  } else if (dh == 64) {
    scores_tiles_held<4>(q2, dh, k2, s);
  } else {
    for (int c = 0; c < kBK / 16; ++c) {
      _tile_zero(0);
      for (int64_t p = 0; p < dh; p += 16) {
        _tile_loadd(4, q2 + p, dh * 4);
        _tile_loadd(6, k2 + p * kBK + 16 * c, kBK * 4);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, s + 16 * c, kBK * 4);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < kTR; ++i)
    for (int c = 0; c < kBK; c += 16)
      _mm512_storeu_ps(s + i * kBK + c, _mm512_mul_ps(_mm512_loadu_ps(s + i * kBK + c), sv));
}

// o[i] = o[i] * alpha[i] + sum_{u<npairs} p2[i][u] . v2[u][...] for kTR rows i, o rows
// dp floats apart (dp a multiple of 32); key pairs 16 a step (the ones past npairs in
// the last step weigh 0: their v2 rows were zeroed). The weights' one or two tiles stay
// loaded across the head dimension, two O tiles at a time; rows whose alpha is 1 (the
// running max held) are not rescaled (x * 1 is x).
inline void values_tiles(const uint32_t* p2, const float* alpha, const uint32_t* v2,
                         int64_t dp, int64_t npairs, float* o) {
  __mmask16 rescale = _mm512_cmp_ps_mask(_mm512_loadu_ps(alpha), _mm512_set1_ps(1.f),
                                         _CMP_NEQ_UQ);
  static_assert(kTR == 16, "one alpha vector per query group");
  while (rescale) {
    const int i = __builtin_ctz(rescale);
    rescale &= rescale - 1;
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int64_t x = 0; x < dp; x += 16)
      _mm512_storeu_ps(o + i * dp + x, _mm512_mul_ps(_mm512_loadu_ps(o + i * dp + x), a));
  }
  const bool two = npairs > 16;  // npairs <= kBK / 2 = 32
  static_assert(kBK / 2 <= 32, "at most two weight tiles");
  _tile_loadd(4, p2, (kBK / 2) * 4);
  if (two) _tile_loadd(5, p2 + 16, (kBK / 2) * 4);
  for (int64_t x = 0; x < dp; x += 32) {
    _tile_loadd(0, o + x, dp * 4);
    _tile_loadd(1, o + x + 16, dp * 4);
    _tile_loadd(6, v2 + x, dp * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, v2 + x + 16, dp * 4);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(6, v2 + 16 * dp + x, dp * 4);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, v2 + 16 * dp + x + 16, dp * 4);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, o + x, dp * 4);
    _tile_stored(1, o + x + 16, dp * 4);
  }
}
#else
constexpr bool kHasTiles = false;
#endif

// The products of run_job: widened fp32 (kWiden), bf16 pairs on vdpbf16ps (kDot: T = C
// = bf16 at a level with AVX512-BF16), or the same pairs on AMX tiles (kTiles: the amx
// level, head sizes a multiple of 32).
enum Path { kWiden, kDot, kTiles };

template <Path kPath, typename T, typename C>
void run_job(const Job& job, const T* q, const C* kv, const int32_t* block_table,
             int64_t q_start, int64_t seq_len, int64_t n_q, const Shape& sh, Scratch& w,
             T* out) {
  constexpr bool kPairs = kPath != kWiden;
  constexpr int64_t RG = kPath == kTiles ? kTR : kR;  // query rows per group
  const int64_t g = sh.g, d = sh.d, dp = sh.dp, h = job.head, dh = (d + 1) / 2;
  const int64_t ctx = seq_len - n_q;
  const int64_t rows = (job.t1 - job.t0) * g, mp = (rows + RG - 1) / RG * RG;
  // Queries as fp32 rows (scaled) or bf16 pairs (unscaled); padding rows stay zero.
  for (int64_t t = job.t0; t < job.t1; ++t)
    for (int64_t j = 0; j < g; ++j) {
      const T* src = q + (q_start + t) * sh.q_tok + (h * g + j) * sh.q_head;
      const int64_t i = (t - job.t0) * g + j;
      if constexpr (kPairs) {
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
        pair_row(src, d, w.q2.data() + i * dh);
#endif
      } else {
        widen_row(src, w.q.data() + i * d, d, sh.scale);
      }
    }
  if constexpr (kPairs) {
    std::fill(w.q2.begin() + rows * dh, w.q2.begin() + mp * dh, 0u);
  } else {
    std::fill(w.q.begin() + rows * d, w.q.begin() + mp * d, 0.f);
  }
  std::fill(w.o.begin(), w.o.begin() + mp * dp, 0.f);
  std::fill(w.m.begin(), w.m.begin() + mp, -INFINITY);
  std::fill(w.l.begin(), w.l.begin() + mp, 0.f);
  std::fill(w.alpha.begin(), w.alpha.begin() + mp, 1.f);

  // Keys the tile can see: from its first row's window start to its last row.
  const int64_t kend = ctx + job.t1;
  const int64_t kstart = sh.window > 0 ? std::max<int64_t>(0, ctx + job.t0 - sh.window + 1) : 0;
  const int32_t* bt = block_table + job.chunk * sh.max_nb;
  for (int64_t kbase = kstart; kbase < kend; kbase += kBK) {
    const int64_t n = std::min<int64_t>(kBK, kend - kbase);
    if constexpr (kPairs) {
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
      // K as pair words transposed into k2[p][j]; V rows j, j + 1 interleaved into
      // v2[j / 2] (an odd n's last pair is (v, 0): its weight pair is (p, 0) too).
      auto row_of = [&](int64_t j) {
        const int64_t pos = kbase + j;
        return kv + bt[pos / sh.bs] * sh.s_block + h * sh.s_head + (pos % sh.bs) * sh.s_tok;
      };
      uint32_t* k2 = w.k2.data();
      int64_t j = 0;
      if (d % 32 == 0) {  // whole 16 x 16 word blocks
        for (; j + 16 <= n; j += 16) {
          const uint32_t* rows[16];
          for (int i = 0; i < 16; ++i)
            rows[i] = reinterpret_cast<const uint32_t*>(row_of(j + i));
          for (int64_t p = 0; p < d / 2; p += 16) {
            const uint32_t* at[16];
            for (int i = 0; i < 16; ++i) at[i] = rows[i] + p;
            transpose_words16(at, k2 + p * kBK + j, kBK);
          }
        }
      }
      for (; j < n; ++j) {
        const C* r = row_of(j);
        for (int64_t p = 0; p < d / 2; ++p) {
          uint32_t word;
          std::memcpy(&word, r + 2 * p, sizeof word);
          k2[p * kBK + j] = word;
        }
        if (d & 1) k2[(dh - 1) * kBK + j] = bf16_bits(r[d - 1]);
      }
      for (int64_t j = 0; j < n; j += 2)
        interleave_rows(row_of(j) + sh.s_kv, j + 1 < n ? row_of(j + 1) + sh.s_kv : nullptr, d,
                        w.v2.data() + j / 2 * dp);
      // The tiles read key pairs 16 at a time: those past a short last tile weigh 0,
      // and must not be an earlier tile's (possibly non-finite) values.
      if (kPath == kTiles && n < kBK)
        std::fill(w.v2.begin() + (n + 1) / 2 * dp, w.v2.begin() + kBK / 2 * dp, 0u);
#endif
    } else {
      // K transposed into kt[d][j], V into v[j][0..d) (its padding columns stay zero).
      for (int64_t j = 0; j < n;) {
        const int64_t pos = kbase + j, off = pos % sh.bs;
        const int64_t run = std::min(n - j, sh.bs - off);
        const C* base = kv + bt[pos / sh.bs] * sh.s_block + h * sh.s_head + off * sh.s_tok;
        for (int64_t u = 0; u < run; ++u, ++j) {
          widen_row(base + u * sh.s_tok, w.row.data(), d, 1.f);
          for (int64_t x = 0; x < d; ++x) w.kt[x * kBK + j] = w.row[x];
          widen_row(base + sh.s_kv + u * sh.s_tok, w.v.data() + j * dp, d, 1.f);
        }
      }
    }
    for (int64_t i0 = 0; i0 < mp; i0 += RG) {
      // The last real row of this register tile sees the most keys (token-major rows).
      const int64_t last = std::min(i0 + RG, rows) - 1;
      const int64_t hi_group = std::min<int64_t>(ctx + job.t0 + last / g + 1 - kbase, n);
      if (hi_group <= 0) {  // no row of the group sees this tile (only under a window
        // can a later tile matter for them: keep their state, add nothing)
        for (int64_t i = i0; i < i0 + RG; ++i) w.alpha[i] = 1.f;
        continue;
      }
      const int cols = static_cast<int>((hi_group + kKeyGroup - 1) / kKeyGroup * kKeyGroup);
      float* s = w.s.data() + i0 * kBK;
      if constexpr (kPath == kTiles) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
        scores_tiles(w.q2.data() + i0 * dh, dh, w.k2.data(), sh.scale, s);
#endif
      } else if constexpr (kPairs) {
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
        scores_rows_bf16(w.q2.data() + i0 * dh, dh, w.k2.data(), cols, sh.scale, s);
#endif
      } else {
        scores_rows(w.q.data() + i0 * d, d, w.kt.data(), d, cols, s);
      }
      for (int64_t i = i0; i < i0 + RG; ++i) {
        float* si = w.s.data() + i * kBK;
        if (i >= rows) {  // padding rows: weights zero, state kept
          std::fill(si, si + kBK, 0.f);
          w.alpha[i] = 1.f;
          continue;
        }
        const int64_t pos = ctx + job.t0 + i / g;
        const int64_t hi = std::min<int64_t>(pos + 1 - kbase, n);
        const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, pos - sh.window + 1 - kbase) : 0;
        if (lo >= hi) {  // nothing of this tile is visible to the row
          std::fill(si, si + kBK, 0.f);
          w.alpha[i] = 1.f;
          continue;
        }
        if (sh.softcap > 0.f) {  // Gemma 2/3: scores become cap * tanh(scores / cap)
          const float inv = 1.f / sh.softcap;
          for (int64_t t = lo; t < hi; ++t) si[t] = sh.softcap * std::tanh(si[t] * inv);
        }
        // Masked columns (only [0, cols) is read from here on) weigh nothing.
        std::fill(si, si + lo, -INFINITY);
        if (hi < cols) std::fill(si + hi, si + cols, -INFINITY);
        Vec vmax = Vec::set1(-INFINITY);
        for (int c = 0; c < cols; c += W) vmax = tmvec::max(vmax, Vec::load(si + c));
        const float m_new = std::max(w.m[i], tmvec::reduce_max(vmax));
        // The rescale of what came before: 0 on the first tile (m = -inf), 1 when the
        // running max holds.
        const float a = m_new == w.m[i] ? 1.f : std::exp(w.m[i] - m_new);
        const Vec mv = Vec::set1(m_new);
        Vec vsum = Vec::zero();
        for (int c = 0; c < cols; c += W) {
          const Vec e = tmvec::exp(Vec::load(si + c) - mv);
          e.store(si + c);
          vsum = vsum + e;
        }
        w.l[i] = w.l[i] * a + tmvec::reduce_add(vsum);
        w.m[i] = m_new;
        w.alpha[i] = a;
      }
      if constexpr (kPairs) {
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
        for (int64_t i = i0; i < i0 + RG; ++i)
          round_weights(w.s.data() + i * kBK, cols, w.p2.data() + i * (kBK / 2));
        if constexpr (kPath == kTiles) {
#if defined(__AMX_BF16__)
          values_tiles(w.p2.data() + i0 * (kBK / 2), w.alpha.data() + i0, w.v2.data(), dp,
                       (hi_group + 1) / 2, w.o.data() + i0 * dp);
#endif
        } else {
          values_all_bf16(w.p2.data() + i0 * (kBK / 2), w.alpha.data() + i0, w.v2.data(), dp,
                          (hi_group + 1) / 2, w.o.data() + i0 * dp);
        }
#endif
      } else {
        values_all(s, w.alpha.data() + i0, w.v.data(), dp, hi_group, w.o.data() + i0 * dp,
                   dp / W);
      }
    }
  }
  for (int64_t t = job.t0; t < job.t1; ++t)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t i = (t - job.t0) * g + j;
      narrow_row(w.o.data() + i * dp, 1.f / w.l[i],
                 out + ((q_start + t) * sh.hq + h * g + j) * d, d);
    }
}

template <typename T, typename C>
void prefill(const T* q, const C* kv, const int32_t* block_table, const int64_t* qsl,
             const int32_t* seq_lens, int64_t num_chunks, const Shape& sh, T* out) {
  // bf16 queries over a bf16 cache: vdpbf16ps where the level has it.
  constexpr bool pairs = kHasBf16Dot && std::is_same_v<T, c10::BFloat16> &&
                         std::is_same_v<C, c10::BFloat16>;
  // ... on AMX tiles where the level has them and whole 16-pair steps cover the head.
  const bool tiles = pairs && kHasTiles && sh.d % 32 == 0;
  const int64_t threads_max = at::get_num_threads();
  int64_t job_rows = kTileRows;
  if (tiles) {  // larger jobs while each thread keeps >= 4 (see kTileRowsTiles)
    int64_t total_rows = 0;
    for (int64_t c = 0; c < num_chunks; ++c) total_rows += (qsl[c + 1] - qsl[c]) * sh.g;
    while (job_rows < kTileRowsTiles &&
           total_rows * sh.hkv >= 2 * job_rows * 4 * threads_max)
      job_rows *= 2;
  }
  const int64_t tile_tokens = std::max<int64_t>(1, job_rows / sh.g);
  std::vector<Job> jobs;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t n_q = qsl[c + 1] - qsl[c], ctx = seq_lens[c] - n_q;
    for (int64_t t0 = 0; t0 < n_q; t0 += tile_tokens) {
      const int64_t t1 = std::min(n_q, t0 + tile_tokens);
      const int64_t first = sh.window > 0 ? std::max<int64_t>(0, ctx + t0 - sh.window + 1) : 0;
      const int64_t cost = (t1 - t0) * (ctx + t1 - first);
      for (int64_t h = 0; h < sh.hkv; ++h) jobs.push_back({c, h, t0, t1, cost});
    }
  }
  // Longest first, taken by whichever thread is free: causal tiles differ in cost.
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const Job& a, const Job& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  const int64_t threads = std::min<int64_t>(threads_max, njobs);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  TORCH_CHECK(!tiles || tmamx::request_tiles(), "paged_prefill: the OS refused the AMX tiles");
#endif
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch w(sh, tile_tokens * sh.g, pairs);
    auto each_job = [&](auto path) {
      for (int64_t k = next++; k < njobs; k = next++) {
        const Job& job = jobs[k];
        run_job<decltype(path)::value>(job, q, kv, block_table, qsl[job.chunk],
                                       seq_lens[job.chunk], qsl[job.chunk + 1] - qsl[job.chunk],
                                       sh, w, out);
      }
    };
    if constexpr (!pairs) {
      each_job(std::integral_constant<Path, kWiden>());
    } else if (!tiles) {
      each_job(std::integral_constant<Path, kDot>());
    } else {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
      tmamx::TileScope scope;
      each_job(std::integral_constant<Path, kTiles>());
#endif
    }
  });
}

}  // namespace

// q [Tq, Hq, D] (head rows contiguous); kv [num_blocks, 2, bs, Hkv, D];
// block_table [P, max_nb] int32; query_start_loc [P + 1] int64 (chunk c's queries are
// q rows [qsl[c], qsl[c+1])); seq_lens [P] int32 (cached prefix + chunk) -> [Tq, Hq, D].
// Query i of chunk c sits at position seq_lens[c] - n_c + i and sees keys up to itself
// (window > 0: only the last `window` of them); softcap > 0 caps the scaled scores.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens,
                            double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_prefill: q must be [Tq, Hq, D] with "
              "contiguous head rows");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.stride(4) == 1 &&
                  kv.stride(3) == kv.size(4),
              "paged_prefill: kv cache must be [num_blocks, 2, block_size, Hkv, D] with "
              "contiguous heads");
  TORCH_CHECK(kv.size(4) == q.size(2), "paged_prefill: q head size ", q.size(2),
              " != kv cache head size ", kv.size(4));
  const bool fp8 = kv.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || kv.scalar_type() == q.scalar_type(),
              "paged_prefill: q and kv cache dtypes differ (the cache may be float8_e4m3fn)");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt &&
                  block_table.is_contiguous(),
              "paged_prefill: block_table must be a contiguous [P, max_nb] int32 tensor");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous(),
              "paged_prefill: query_start_loc must be a contiguous [P + 1] int64 tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "paged_prefill: seq_lens must be a contiguous [P] int32 tensor");
  const int64_t num_chunks = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_chunks + 1 && block_table.size(0) >= num_chunks,
              "paged_prefill: query_start_loc needs P + 1 entries and block_table P rows "
              "for the P = ", num_chunks, " seq_lens");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0,
              "paged_prefill: query heads must be a multiple of kv heads");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t bs = kv.size(2);
  TORCH_CHECK(num_chunks == 0 || (qsl[0] >= 0 && qsl[num_chunks] <= q.size(0)),
              "paged_prefill: query_start_loc outside q's ", q.size(0), " rows");
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t n_q = qsl[c + 1] - qsl[c];
    TORCH_CHECK(n_q >= 0 && lens[c] >= n_q, "paged_prefill: chunk ", c, " has ", n_q,
                " queries but seq_lens ", lens[c]);
    TORCH_CHECK((lens[c] + bs - 1) / bs <= block_table.size(1), "paged_prefill: chunk ", c,
                "'s seq_lens ", lens[c], " needs more blocks than block_table's ",
                block_table.size(1));
  }
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t d = q.size(2);
  Shape sh{q.size(1), kv.size(3), q.size(1) / kv.size(3), d, (d + W - 1) / W * W,
           q.stride(0), q.stride(1), bs, block_table.size(1), kv.stride(0), kv.stride(1),
           kv.stride(2), kv.stride(3), static_cast<float>(scale), static_cast<float>(softcap),
           window};
  auto run = [&](auto q_tag, auto cache_tag) {
    using T = decltype(q_tag);
    using C = decltype(cache_tag);
    prefill<T, C>(reinterpret_cast<const T*>(q.data_ptr()),
                  reinterpret_cast<const C*>(kv.data_ptr()), block_table.data_ptr<int32_t>(),
                  qsl, lens, num_chunks, sh, reinterpret_cast<T*>(out.data_ptr()));
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
    default: TORCH_CHECK(false, "paged_prefill: unsupported dtype ", q.scalar_type());
  }
  return out;
}
