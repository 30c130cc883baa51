// Integer codes widened to fp32 lanes of vec.h's Vec, at every ISA: the packed 8- and
// 4-bit weights of cpu_quant_linear.cpp. Exact: every code is an fp32 integer.
//
// - load_u8(p): W bytes from p, lane i = p[i];
// - load_u4_pairs(p, lo, hi): W bytes from p, lo lane i = p[i] & 0xf, hi = p[i] >> 4.
// Both read exactly W bytes. Standalone like vec.h (tests/kernels/vec_check.cpp).
#pragma once

#include "vec.h"

namespace tmvec {

#if defined(TM_VEC_AVX512)
// 16 bytes -> 16 i32 lanes (reads exactly 16 bytes).
static inline __m512i load_u8_lanes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline Vec load_u8(const uint8_t* p) { return Vec(_mm512_cvtepi32_ps(load_u8_lanes(p))); }
static inline void load_u4_pairs(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i b = load_u8_lanes(p);
  lo = Vec(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xf))));
  hi = Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
}
#elif defined(TM_VEC_AVX2)
// 8 bytes -> 8 i32 lanes (reads exactly 8 bytes).
static inline __m256i load_u8_lanes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline Vec load_u8(const uint8_t* p) { return Vec(_mm256_cvtepi32_ps(load_u8_lanes(p))); }
static inline void load_u4_pairs(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i b = load_u8_lanes(p);
  lo = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xf))));
  hi = Vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
}
#elif defined(TM_VEC_NEON)
// 4 bytes -> 4 u32 lanes (reads exactly 4 bytes).
static inline uint32x4_t load_u8_lanes(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
  return vmovl_u16(vget_low_u16(vmovl_u8(b)));
}
static inline Vec load_u8(const uint8_t* p) { return Vec(vcvtq_f32_u32(load_u8_lanes(p))); }
static inline void load_u4_pairs(const uint8_t* p, Vec& lo, Vec& hi) {
  const uint32x4_t b = load_u8_lanes(p);
  lo = Vec(vcvtq_f32_u32(vandq_u32(b, vdupq_n_u32(0xf))));
  hi = Vec(vcvtq_f32_u32(vshrq_n_u32(b, 4)));
}
#elif defined(TM_VEC_SSE2)
// 4 bytes -> 4 i32 lanes (reads exactly 4 bytes).
static inline __m128i load_u8_lanes(const uint8_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof(w));
  const __m128i zero = _mm_setzero_si128();
  return _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w), zero), zero);
}
static inline Vec load_u8(const uint8_t* p) { return Vec(_mm_cvtepi32_ps(load_u8_lanes(p))); }
static inline void load_u4_pairs(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m128i b = load_u8_lanes(p);
  lo = Vec(_mm_cvtepi32_ps(_mm_and_si128(b, _mm_set1_epi32(0xf))));
  hi = Vec(_mm_cvtepi32_ps(_mm_srli_epi32(b, 4)));
}
#else  // plain arrays
static inline Vec load_u8(const uint8_t* p) {
  Vec r;
  for (int i = 0; i < Vec::W; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
static inline void load_u4_pairs(const uint8_t* p, Vec& lo, Vec& hi) {
  for (int i = 0; i < Vec::W; ++i) {
    lo.v[i] = static_cast<float>(p[i] & 0xf);
    hi.v[i] = static_cast<float>(p[i] >> 4);
  }
}
#endif

}  // namespace tmvec
