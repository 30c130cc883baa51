// tokenmill/kernels/vec_fp8.h checked on its own: every float8_e4m3fn code but the two
// NaNs widened by this build's vector path (load_e4m3, and load_e4m3_over256: the value
// x 2^-8) against c10's scalar conversion, bit for bit, at each of the W lane
// positions; and e4m3_saturate's clamp at +-448.
// Prints "W=<lanes>: <n> failures" (tests/unit/test_kv_cache_fp8_kernels.py runs it
// per level, on the plain-array fallback and on aarch64 NEON under qemu-user).
#include <cmath>
#include <cstdio>
#include <cstring>

#include "../../tokenmill/kernels/vec_fp8.h"

int main() {
  using tmvec::Vec;
  constexpr int W = Vec::W;
  int failures = 0;
  for (int lane = 0; lane < W; ++lane) {
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7f) == 0x7f) continue;  // NaN
      uint8_t in[W];
      for (int i = 0; i < W; ++i) in[i] = static_cast<uint8_t>((code + 37 * i) & 0x7e);
      in[lane] = static_cast<uint8_t>(code);
      float out[W], over[W];
      tmvec::load_e4m3(in).store(out);
      tmvec::load_e4m3_over256(in).store(over);
      for (int i = 0; i < W; ++i) {
        const float want = tmvec::e4m3_to_float(in[i]);
        const float want_over = want * (1.f / 256);  // exact: a power of two
        uint32_t a, b, c, d;
        std::memcpy(&a, &out[i], 4);
        std::memcpy(&b, &want, 4);
        std::memcpy(&c, &over[i], 4);
        std::memcpy(&d, &want_over, 4);
        if (a != b || c != d) {
          if (failures < 10)
            std::printf("code 0x%02x lane %d: got %g, %g x 2^-8; want %g\n", in[i], i, out[i],
                        over[i] * 256, want);
          ++failures;
        }
      }
    }
  }
  // Saturation: beyond the range clamps to the largest finite code, never NaN.
  const float big[] = {448.f, 460.f, 480.f, 1e6f, INFINITY};
  for (float x : big) {
    if (tmvec::e4m3_saturate(x).x != 0x7e || tmvec::e4m3_saturate(-x).x != 0xfe) {
      std::printf("saturate %g: 0x%02x\n", x, tmvec::e4m3_saturate(x).x);
      ++failures;
    }
  }
  std::printf("W=%d: %d failures\n", W, failures);
  return 0;
}
