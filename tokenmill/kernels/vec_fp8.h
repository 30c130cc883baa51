// float8_e4m3fn (the FP8 KV cache's element, FP8 weights' codes) widened to vec.h's
// fp32 Vec, per ISA.
//
// e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
// 0x7f / 0xff are NaN, the largest finite value is 448. Every e4m3 value is exact
// in fp16 and fp32, so widening is exact: these loads return the value torch's
// float8_e4m3fn -> float32 cast returns, for all 254 non-NaN codes.
//
// Where the ISA converts fp16 (F16C on AVX2 / AVX-512, NEON's vcvt), the e4m3 bits
// are placed in an fp16's: sign to bit 15, exponent and mantissa to bits 13..7 (the
// byte sign-extended to 16 bits and shifted left by 7 has them there, and the sign
// again in bit 14, which one mask clears). That fp16 is the e4m3 value times 2^-8
// (fp16's exponent bias is 15, e4m3's 7), normal or subnormal alike, so one multiply
// by 2^8 finishes it. `load_e4m3_over256` stops before it (value x 2^-8, exact:
// every such value is a normal fp32), for kernels that fold the 2^8 into a scale
// they multiply by anyway, once per group rather than per weight (cpu_quant_linear.cpp).
// SSE2 has no fp16 conversion: the exponent is rebiased in the fp32 bits (+120), and
// subnormals (exponent 0: mantissa x 2^-9) are converted from the integer mantissa;
// there (and on the generic path) load_e4m3_over256 is load_e4m3's value x 2^-8.
// The NaN codes widen to +-480 on those paths (the cache writes never store NaN:
// they saturate at +-448, see e4m3_saturate); the generic path returns NaN.
//
// Narrowing (fp32 -> e4m3) is scalar: c10's conversion (round to nearest even),
// after clamping to +-448: the torch this builds against saturates by itself, older
// releases gave NaN past the range; the clamp makes the codes the same under both.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace tmvec {

constexpr float kE4m3Max = 448.f;

// The scalar widening (tails, the generic path): c10's exact conversion.
static inline float e4m3_to_float(uint8_t bits) {
  return static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()));
}

// x rounded to e4m3 (nearest even), saturating at +-448; NaN stays NaN.
static inline c10::Float8_e4m3fn e4m3_saturate(float x) {
  return c10::Float8_e4m3fn(x < -kE4m3Max ? -kE4m3Max : (x > kE4m3Max ? kE4m3Max : x));
}

// The fp16 bits of the e4m3 value times 2^-8: sign, exponent and mantissa in place.
constexpr int16_t kE4m3HalfMask = static_cast<int16_t>(0xbf80);

#if defined(TM_VEC_AVX512)
// 16 codes -> 16 fp32 lanes.
static inline Vec load_e4m3_over256(const uint8_t* p) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(kE4m3HalfMask));
  return Vec(_mm512_cvtph_ps(h));
}
static inline Vec load_e4m3(const uint8_t* p) {
  return Vec(_mm512_mul_ps(load_e4m3_over256(p).v, _mm512_set1_ps(256.f)));
}

#elif defined(TM_VEC_AVX2)
// 8 codes -> 8 fp32 lanes (SSE4.1's sign extension: -mavx2 implies it).
static inline Vec load_e4m3_over256(const uint8_t* p) {
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(kE4m3HalfMask));
  return Vec(_mm256_cvtph_ps(h));
}
static inline Vec load_e4m3(const uint8_t* p) {
  return Vec(_mm256_mul_ps(load_e4m3_over256(p).v, _mm256_set1_ps(256.f)));
}

#elif defined(TM_VEC_NEON)
// 4 codes -> 4 fp32 lanes (reads exactly 4 bytes).
static inline Vec load_e4m3_over256(const uint8_t* p) {
  uint32_t four;
  std::memcpy(&four, p, sizeof(four));
  const int16x4_t w = vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(four))));
  const int16x4_t h = vand_s16(vshl_n_s16(w, 7), vdup_n_s16(kE4m3HalfMask));
  return Vec(vcvt_f32_f16(vreinterpret_f16_s16(h)));
}
static inline Vec load_e4m3(const uint8_t* p) {
  return Vec(vmulq_n_f32(load_e4m3_over256(p).v, 256.f));
}

#elif defined(TM_VEC_SSE2)
// 4 codes -> 4 fp32 lanes: the exponent rebiased in the fp32 bits; subnormals from the
// integer mantissa (exact: m x 2^-9), never through an fp32 denormal (which DAZ zeroes).
static inline Vec load_e4m3(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  const __m128i zero = _mm_setzero_si128();
  const __m128i w = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(four), zero), zero);
  const __m128i mag = _mm_and_si128(w, _mm_set1_epi32(0x7f));
  const __m128i normal = _mm_add_epi32(_mm_slli_epi32(mag, 20), _mm_set1_epi32(120 << 23));
  const __m128 sub = _mm_mul_ps(_mm_cvtepi32_ps(_mm_and_si128(w, _mm_set1_epi32(7))),
                                _mm_set1_ps(1.f / 512));
  const __m128i is_sub = _mm_cmplt_epi32(mag, _mm_set1_epi32(8));  // exponent 0
  const __m128i bits = _mm_or_si128(_mm_andnot_si128(is_sub, normal),
                                    _mm_and_si128(is_sub, _mm_castps_si128(sub)));
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(w, _mm_set1_epi32(0x80)), 24);
  return Vec(_mm_castsi128_ps(_mm_or_si128(bits, sign)));
}
static inline Vec load_e4m3_over256(const uint8_t* p) {
  return load_e4m3(p) * Vec::set1(1.f / 256);
}

#else
static inline Vec load_e4m3(const uint8_t* p) {
  Vec r;
  for (int i = 0; i < Vec::W; ++i) r.v[i] = e4m3_to_float(p[i]);
  return r;
}
static inline Vec load_e4m3_over256(const uint8_t* p) {
  return load_e4m3(p) * Vec::set1(1.f / 256);
}
#endif

static inline Vec load_e4m3(const c10::Float8_e4m3fn* p) {
  return load_e4m3(reinterpret_cast<const uint8_t*>(p));
}

// W elements of a K/V cache of element type T, widened to fp32 lanes.
template <typename T>
static inline Vec load_wide(const T* p) {
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    return load_e4m3(p);
  } else {
    return Vec::load(p);
  }
}

}  // namespace tmvec
