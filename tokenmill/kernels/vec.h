// A portable fp32 vector for the native kernels: one kernel source, every ISA.
//
// `Vec` is W fp32 lanes in the widest registers the capability level's flags allow:
// AVX-512 (16 lanes), AVX2 + FMA (8), NEON on aarch64 (4), SSE2 (4: the x86-64
// baseline), or plain arrays of 4 elsewhere (correct, not fast: there the
// bindings report has_fast_linear_bf16 = False and Linear keeps its GEMM). The
// kernels are written against it once; kernels/__init__.py compiles them once per
// level. What a lane computes is the same everywhere (fp32 products and sums,
// round-to-nearest-even narrowing); only the order of the sums follows W.
//
// No <torch/...> here: this header must also compile on its own (tests/kernels,
// the aarch64 cross-compile check), so it needs only c10's scalar types.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(TM_VEC_FORCE_GENERIC)  // tests: the plain-array fallback on any CPU
#define TM_VEC_GENERIC 1
#elif defined(__AVX512F__)
#define TM_VEC_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_VEC_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define TM_VEC_NEON 1
#include <arm_neon.h>
#elif defined(__SSE2__)
#define TM_VEC_SSE2 1  // the x86-64 baseline (a CPU from before AVX2)
#include <emmintrin.h>
#else
#define TM_VEC_GENERIC 1
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>  // _mm_prefetch: SSE, in every x86-64 build
#endif

namespace tmvec {

// Hint the line holding p into L1 ahead of use (streaming weights at batch 1).
static inline void prefetch(const void* p) {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#elif defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}

// The same into L2 only: many lines ahead (scattered KV cache blocks) without
// stalling on L1's few outstanding misses.
static inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#elif defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);
#endif
}

#if defined(TM_VEC_AVX512)
// ---------------------------------------------------------------- AVX-512
struct Vec {
  static constexpr int W = 16;
  static constexpr int kRegs = 32;  // architectural vector registers
  __m512 v;
  Vec() = default;
  explicit Vec(__m512 x) : v(x) {}
  static Vec zero() { return Vec(_mm512_setzero_ps()); }
  static Vec set1(float f) { return Vec(_mm512_set1_ps(f)); }
  static Vec load(const float* p) { return Vec(_mm512_loadu_ps(p)); }
  static Vec load(const c10::BFloat16* p) {
    // bf16 is the top half of an fp32: widen to 32 bits and shift into place (exact).
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  static Vec load(const c10::Half* p) {
    return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  // The first n lanes (0 <= n <= W) from p, the rest zero; reads nothing past p + n.
  static Vec load_n(const float* p, int n) {
    return Vec(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_n(float* p, int n) const {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  // Lanes whose bits, as fp32, are c10's bf16 rounding of v (RNE, NaN stays NaN).
  Vec round_bf16() const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
    return Vec(_mm512_castsi512_ps(r));
  }
  void store(c10::BFloat16* p) const {
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16().v), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  __m256i half_bits() const {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  void store(c10::Half* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half_bits());
  }
  Vec round_half() const { return Vec(_mm512_cvtph_ps(half_bits())); }
};
static inline Vec operator+(Vec a, Vec b) { return Vec(_mm512_add_ps(a.v, b.v)); }
static inline Vec operator-(Vec a, Vec b) { return Vec(_mm512_sub_ps(a.v, b.v)); }
static inline Vec operator*(Vec a, Vec b) { return Vec(_mm512_mul_ps(a.v, b.v)); }
static inline Vec operator/(Vec a, Vec b) { return Vec(_mm512_div_ps(a.v, b.v)); }
static inline Vec fma(Vec a, Vec b, Vec c) { return Vec(_mm512_fmadd_ps(a.v, b.v, c.v)); }
static inline Vec max(Vec a, Vec b) { return Vec(_mm512_max_ps(a.v, b.v)); }
static inline Vec min(Vec a, Vec b) { return Vec(_mm512_min_ps(a.v, b.v)); }
static inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
// [sum a, sum b, sum c, sum d] of four registers' lanes: one transposing tree (14
// instructions, not 4 reductions of 8).
static inline __m128 reduce_add4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 256-bit halves: lanes 0-7 hold a's partials, 8-15 b's (and c's, d's)
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // 128-bit lanes: lane 0 a's 4 partials, 1 b's, 2 c's, 3 d's
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, x));
}
// out[0..4) = the lane sums of a, b, c, d.
static inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  _mm_storeu_ps(out, reduce_add4_ps(a.v, b.v, c.v, d.v));
}
static inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
// Round to the nearest integer (ties to even), as a float.
static inline Vec round_int(Vec a) {
  return Vec(_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// 2^n for integer-valued n in [-126, 127].
static inline Vec pow2(Vec n) {
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}
// a where x > t, else 0 (also where x is NaN).
static inline Vec keep_if_gt(Vec a, Vec x, Vec t) {
  return Vec(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, t.v, _CMP_GT_OQ), a.v));
}
// Packed bf16 pairs: W dwords from p (2W bf16). lo = the low halves widened, hi =
// the high halves (the interleaved layout of cpu_linear.cpp; two ALU ops, exact).
static inline void load_bf16_pairs(const uint16_t* p, Vec& lo, Vec& hi) {
  const __m512i w = _mm512_loadu_si512(p);
  lo = Vec(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  hi = Vec(_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
}

#elif defined(TM_VEC_AVX2)
// ---------------------------------------------------------------- AVX2 + FMA + F16C
struct Vec {
  static constexpr int W = 8;
  static constexpr int kRegs = 16;
  __m256 v;
  Vec() = default;
  explicit Vec(__m256 x) : v(x) {}
  static Vec zero() { return Vec(_mm256_setzero_ps()); }
  static Vec set1(float f) { return Vec(_mm256_set1_ps(f)); }
  static Vec load(const float* p) { return Vec(_mm256_loadu_ps(p)); }
  static Vec load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
  static Vec load(const c10::Half* p) {
    return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static __m256i mask_n(int n) {
    // lane i is all ones when i < n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load_n(const float* p, int n) { return Vec(_mm256_maskload_ps(p, mask_n(n))); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_n(float* p, int n) const { _mm256_maskstore_ps(p, mask_n(n), v); }
  Vec round_bf16() const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return Vec(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
  }
  void store(c10::BFloat16* p) const {
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16().v), 16);
    // 8 dwords -> 8 words: pack within 128-bit lanes, then take lanes 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  __m128i half_bits() const {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  void store(c10::Half* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), half_bits()); }
  Vec round_half() const { return Vec(_mm256_cvtph_ps(half_bits())); }
};
static inline Vec operator+(Vec a, Vec b) { return Vec(_mm256_add_ps(a.v, b.v)); }
static inline Vec operator-(Vec a, Vec b) { return Vec(_mm256_sub_ps(a.v, b.v)); }
static inline Vec operator*(Vec a, Vec b) { return Vec(_mm256_mul_ps(a.v, b.v)); }
static inline Vec operator/(Vec a, Vec b) { return Vec(_mm256_div_ps(a.v, b.v)); }
static inline Vec fma(Vec a, Vec b, Vec c) { return Vec(_mm256_fmadd_ps(a.v, b.v, c.v)); }
static inline Vec max(Vec a, Vec b) { return Vec(_mm256_max_ps(a.v, b.v)); }
static inline Vec min(Vec a, Vec b) { return Vec(_mm256_min_ps(a.v, b.v)); }
static inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const __m256 ab = _mm256_hadd_ps(a.v, b.v), cd = _mm256_hadd_ps(c.v, d.v);
  const __m256 x = _mm256_hadd_ps(ab, cd);  // per 128-bit half: a, b, c, d partial sums
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
}
static inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline Vec round_int(Vec a) {
  return Vec(_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline Vec pow2(Vec n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
static inline Vec keep_if_gt(Vec a, Vec x, Vec t) {
  return Vec(_mm256_and_ps(a.v, _mm256_cmp_ps(x.v, t.v, _CMP_GT_OQ)));
}
static inline void load_bf16_pairs(const uint16_t* p, Vec& lo, Vec& hi) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  hi = Vec(_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))));
}

#elif defined(TM_VEC_NEON)
// ---------------------------------------------------------------- NEON (aarch64)
struct Vec {
  static constexpr int W = 4;
  static constexpr int kRegs = 32;
  float32x4_t v;
  Vec() = default;
  explicit Vec(float32x4_t x) : v(x) {}
  static Vec zero() { return Vec(vdupq_n_f32(0.f)); }
  static Vec set1(float f) { return Vec(vdupq_n_f32(f)); }
  static Vec load(const float* p) { return Vec(vld1q_f32(p)); }
  static Vec load(const c10::BFloat16* p) {
    const uint16x4_t raw = vld1_u16(reinterpret_cast<const uint16_t*>(p));
    return Vec(vreinterpretq_f32_u32(vshll_n_u16(raw, 16)));
  }
  static Vec load(const c10::Half* p) {
    return Vec(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)))));
  }
  static Vec load_n(const float* p, int n) {
    float tmp[W] = {0.f, 0.f, 0.f, 0.f};
    std::memcpy(tmp, p, sizeof(float) * n);
    return load(tmp);
  }
  void store(float* p) const { vst1q_f32(p, v); }
  void store_n(float* p, int n) const {
    float tmp[W];
    store(tmp);
    std::memcpy(p, tmp, sizeof(float) * n);
  }
  uint32x4_t bf16_bits32() const {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
    r = vandq_u32(r, vdupq_n_u32(0xffff0000u));
    const uint32x4_t ordered = vceqq_f32(v, v);  // all ones unless NaN
    return vbslq_u32(ordered, r, vdupq_n_u32(0x7fc00000u));
  }
  Vec round_bf16() const { return Vec(vreinterpretq_f32_u32(bf16_bits32())); }
  void store(c10::BFloat16* p) const {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vshrn_n_u32(bf16_bits32(), 16));
  }
  void store(c10::Half* p) const {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(v)));
  }
  Vec round_half() const { return Vec(vcvt_f32_f16(vcvt_f16_f32(v))); }
};
static inline Vec operator+(Vec a, Vec b) { return Vec(vaddq_f32(a.v, b.v)); }
static inline Vec operator-(Vec a, Vec b) { return Vec(vsubq_f32(a.v, b.v)); }
static inline Vec operator*(Vec a, Vec b) { return Vec(vmulq_f32(a.v, b.v)); }
static inline Vec operator/(Vec a, Vec b) { return Vec(vdivq_f32(a.v, b.v)); }
static inline Vec fma(Vec a, Vec b, Vec c) { return Vec(vfmaq_f32(c.v, a.v, b.v)); }
static inline Vec max(Vec a, Vec b) { return Vec(vmaxq_f32(a.v, b.v)); }
static inline Vec min(Vec a, Vec b) { return Vec(vminq_f32(a.v, b.v)); }
static inline float reduce_add(Vec a) { return vaddvq_f32(a.v); }
static inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  vst1q_f32(out, vpaddq_f32(vpaddq_f32(a.v, b.v), vpaddq_f32(c.v, d.v)));
}
static inline float reduce_max(Vec a) { return vmaxvq_f32(a.v); }
static inline Vec round_int(Vec a) { return Vec(vrndnq_f32(a.v)); }
static inline Vec pow2(Vec n) {
  const int32x4_t e = vaddq_s32(vcvtnq_s32_f32(n.v), vdupq_n_s32(127));
  return Vec(vreinterpretq_f32_s32(vshlq_n_s32(e, 23)));
}
static inline Vec keep_if_gt(Vec a, Vec x, Vec t) {
  return Vec(vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.v), vcgtq_f32(x.v, t.v))));
}
static inline void load_bf16_pairs(const uint16_t* p, Vec& lo, Vec& hi) {
  const uint32x4_t w = vld1q_u32(reinterpret_cast<const uint32_t*>(p));
  lo = Vec(vreinterpretq_f32_u32(vshlq_n_u32(w, 16)));
  hi = Vec(vreinterpretq_f32_u32(vandq_u32(w, vdupq_n_u32(0xffff0000u))));
}

#elif defined(TM_VEC_SSE2)
// ---------------------------------------------------------------- SSE2 (x86-64 baseline)
// No FMA here: fma is a product then a sum.
struct Vec {
  static constexpr int W = 4;
  static constexpr int kRegs = 16;
  __m128 v;
  Vec() = default;
  explicit Vec(__m128 x) : v(x) {}
  static Vec zero() { return Vec(_mm_setzero_ps()); }
  static Vec set1(float f) { return Vec(_mm_set1_ps(f)); }
  static Vec load(const float* p) { return Vec(_mm_loadu_ps(p)); }
  static Vec load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return Vec(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), raw)));
  }
  static Vec load(const c10::Half* p) {
    float tmp[W];
    for (int i = 0; i < W; ++i) tmp[i] = static_cast<float>(p[i]);
    return load(tmp);
  }
  static Vec load_n(const float* p, int n) {
    float tmp[W] = {0.f, 0.f, 0.f, 0.f};
    std::memcpy(tmp, p, sizeof(float) * n);
    return load(tmp);
  }
  void store(float* p) const { _mm_storeu_ps(p, v); }
  void store_n(float* p, int n) const {
    float tmp[W];
    store(tmp);
    std::memcpy(p, tmp, sizeof(float) * n);
  }
  Vec round_bf16() const {
    const __m128i u = _mm_castps_si128(v);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7fff)));
    r = _mm_and_si128(r, _mm_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
    r = _mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, _mm_set1_epi32(0x7fc00000)));
    return Vec(_mm_castsi128_ps(r));
  }
  void store(c10::BFloat16* p) const {
    alignas(16) uint32_t bits[W];
    _mm_store_si128(reinterpret_cast<__m128i*>(bits), _mm_castps_si128(round_bf16().v));
    auto* out = reinterpret_cast<uint16_t*>(p);
    for (int i = 0; i < W; ++i) out[i] = static_cast<uint16_t>(bits[i] >> 16);
  }
  void store(c10::Half* p) const {
    float tmp[W];
    store(tmp);
    for (int i = 0; i < W; ++i) p[i] = c10::Half(tmp[i]);
  }
  Vec round_half() const {
    float tmp[W];
    store(tmp);
    for (int i = 0; i < W; ++i) tmp[i] = static_cast<float>(c10::Half(tmp[i]));
    return load(tmp);
  }
};
static inline Vec operator+(Vec a, Vec b) { return Vec(_mm_add_ps(a.v, b.v)); }
static inline Vec operator-(Vec a, Vec b) { return Vec(_mm_sub_ps(a.v, b.v)); }
static inline Vec operator*(Vec a, Vec b) { return Vec(_mm_mul_ps(a.v, b.v)); }
static inline Vec operator/(Vec a, Vec b) { return Vec(_mm_div_ps(a.v, b.v)); }
static inline Vec fma(Vec a, Vec b, Vec c) { return Vec(_mm_add_ps(_mm_mul_ps(a.v, b.v), c.v)); }
static inline Vec max(Vec a, Vec b) { return Vec(_mm_max_ps(a.v, b.v)); }
static inline Vec min(Vec a, Vec b) { return Vec(_mm_min_ps(a.v, b.v)); }
static inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(a.v, _mm_movehl_ps(a.v, a.v));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
static inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  __m128 r0 = a.v, r1 = b.v, r2 = c.v, r3 = d.v;
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(r0, r1), _mm_add_ps(r2, r3)));
}
static inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(a.v, _mm_movehl_ps(a.v, a.v));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
static inline Vec round_int(Vec a) {
  // cvtps rounds to nearest even under the default MXCSR mode; |a| < 2^31 here.
  return Vec(_mm_cvtepi32_ps(_mm_cvtps_epi32(a.v)));
}
static inline Vec pow2(Vec n) {
  const __m128i e = _mm_add_epi32(_mm_cvtps_epi32(n.v), _mm_set1_epi32(127));
  return Vec(_mm_castsi128_ps(_mm_slli_epi32(e, 23)));
}
static inline Vec keep_if_gt(Vec a, Vec x, Vec t) {
  return Vec(_mm_and_ps(a.v, _mm_cmpgt_ps(x.v, t.v)));
}
static inline void load_bf16_pairs(const uint16_t* p, Vec& lo, Vec& hi) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = Vec(_mm_castsi128_ps(_mm_slli_epi32(w, 16)));
  hi = Vec(_mm_castsi128_ps(_mm_and_si128(w, _mm_set1_epi32(static_cast<int>(0xffff0000u)))));
}

#else
// ---------------------------------------------------------------- generic
// Plain arrays: the compiler vectorises what it can (SSE2 on the x86-64 baseline).
// fma is a product then a sum: a CPU without FMA would emulate std::fma slowly.
struct Vec {
  static constexpr int W = 4;
  static constexpr int kRegs = 16;
  float v[W];
  static Vec zero() { return set1(0.f); }
  static Vec set1(float f) {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = f;
    return r;
  }
  template <typename T>
  static Vec load(const T* p) {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static Vec load_n(const float* p, int n) {
    Vec r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < W; ++i) p[i] = v[i];
  }
  void store_n(float* p, int n) const {
    for (int i = 0; i < n; ++i) p[i] = v[i];
  }
  void store(c10::BFloat16* p) const {
    for (int i = 0; i < W; ++i) p[i] = c10::BFloat16(v[i]);
  }
  void store(c10::Half* p) const {
    for (int i = 0; i < W; ++i) p[i] = c10::Half(v[i]);
  }
  Vec round_bf16() const {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(c10::BFloat16(v[i]));
    return r;
  }
  Vec round_half() const {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(c10::Half(v[i]));
    return r;
  }
};
#define TM_VEC_LANEWISE(expr)                 \
  Vec r;                                      \
  for (int i = 0; i < Vec::W; ++i) r.v[i] = (expr); \
  return r
static inline Vec operator+(Vec a, Vec b) { TM_VEC_LANEWISE(a.v[i] + b.v[i]); }
static inline Vec operator-(Vec a, Vec b) { TM_VEC_LANEWISE(a.v[i] - b.v[i]); }
static inline Vec operator*(Vec a, Vec b) { TM_VEC_LANEWISE(a.v[i] * b.v[i]); }
static inline Vec operator/(Vec a, Vec b) { TM_VEC_LANEWISE(a.v[i] / b.v[i]); }
static inline Vec fma(Vec a, Vec b, Vec c) { TM_VEC_LANEWISE(a.v[i] * b.v[i] + c.v[i]); }
// Where either lane is NaN these return b, as x86's max/min do (exp relies on it).
static inline Vec max(Vec a, Vec b) { TM_VEC_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
static inline Vec min(Vec a, Vec b) { TM_VEC_LANEWISE(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
static inline Vec round_int(Vec a) { TM_VEC_LANEWISE(std::nearbyint(a.v[i])); }
static inline Vec pow2(Vec n) {
  Vec r;
  for (int i = 0; i < Vec::W; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    std::memcpy(&r.v[i], &bits, sizeof(float));
  }
  return r;
}
static inline Vec keep_if_gt(Vec a, Vec x, Vec t) { TM_VEC_LANEWISE(x.v[i] > t.v[i] ? a.v[i] : 0.f); }
#undef TM_VEC_LANEWISE
static inline float reduce_add(Vec a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
static inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  out[0] = reduce_add(a);
  out[1] = reduce_add(b);
  out[2] = reduce_add(c);
  out[3] = reduce_add(d);
}
static inline float reduce_max(Vec a) {
  return std::max(std::max(a.v[0], a.v[1]), std::max(a.v[2], a.v[3]));
}
static inline void load_bf16_pairs(const uint16_t* p, Vec& lo, Vec& hi) {
  for (int i = 0; i < Vec::W; ++i) {
    uint32_t w;
    std::memcpy(&w, p + 2 * i, sizeof(w));
    const uint32_t l = w << 16, h = w & 0xffff0000u;
    std::memcpy(&lo.v[i], &l, sizeof(float));
    std::memcpy(&hi.v[i], &h, sizeof(float));
  }
}
#endif

// ---------------------------------------------------------------- on every ISA

// The value a T-typed op would have stored: round to T and widen back.
template <typename T>
static inline Vec round_to(Vec a) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return a.round_bf16();
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return a.round_half();
  } else {
    return a;
  }
}

// exp(x) per lane: 2^(x log2 e) split into an integer power n and a degree-6
// polynomial of e^f, f = x - n ln2 in [-ln2/2, ln2/2] (relative error ~1e-7, as
// expf). x is clamped to [-87.3, 88.3], where 2^n stays a normal float: below, the
// result is 0 (exp(-inf) = 0, and NaN gives 0 too); above, a large finite value.
static inline Vec exp(Vec x) {
  const Vec lowest = Vec::set1(-87.3f);
  const Vec xc = min(max(x, lowest), Vec::set1(88.3f));
  const Vec n = round_int(xc * Vec::set1(1.4426950408889634f));
  // ln2 as hi + lo (Cody-Waite) so f stays accurate when n is large
  Vec f = xc - n * Vec::set1(0.693145751953125f);
  f = f - n * Vec::set1(1.428606765330187e-06f);
  Vec p = Vec::set1(1.f / 720);
  p = fma(p, f, Vec::set1(1.f / 120));
  p = fma(p, f, Vec::set1(1.f / 24));
  p = fma(p, f, Vec::set1(1.f / 6));
  p = fma(p, f, Vec::set1(0.5f));
  p = fma(p, f, Vec::set1(1.f));
  p = fma(p, f, Vec::set1(1.f));
  return keep_if_gt(p * pow2(n), x, lowest);
}

}  // namespace tmvec
