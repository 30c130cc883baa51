// Checks tokenmill/kernels/vec.h and vec_int.h lane by lane against c10's scalar
// conversions and libm, for whichever ISA the compiler flags select (tests/unit/test_vec_header.py
// builds it once per capability level, and for aarch64 under qemu when it can).
// Prints one line per failure; the exit status is the number of failures (max 100).
#include "../../tokenmill/kernels/vec.h"
#include "../../tokenmill/kernels/vec_int.h"

#include <cstdio>
#include <limits>
#include <random>
#include <vector>

using tmvec::Vec;

static int failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      if (++failures <= 20) {                             \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__);  \
        std::printf(__VA_ARGS__);                         \
        std::printf("\n");                                \
      }                                                   \
    }                                                     \
  } while (0)

static uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static bool same(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }

int main() {
  constexpr int W = Vec::W;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 3.f);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> special = {0.f, -0.f, 1.f, -1.f, inf, -inf, std::nanf(""), 1e-40f, -3e-39f,
                                3.3895314e38f, 65504.f, 70000.f, 1.00390625f, 1.01171875f,
                                1.0078125f, 2.5f, -2.5f, 0.5f, 1e-8f, 123456.789f};
  std::vector<float> xs(special);
  for (int i = 0; i < 4000; ++i) xs.push_back(normal(rng) * (i % 7 == 0 ? 1000.f : 1.f));
  while (xs.size() % W) xs.push_back(0.25f);
  const int n = static_cast<int>(xs.size());

  for (int i = 0; i < n; i += W) {
    const float* x = xs.data() + i;
    float out[W];
    Vec::load(x).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], x[j]), "load/store %g", x[j]);
    // bf16: store rounds as c10 does; load widens exactly; round_to = both.
    c10::BFloat16 b[W];
    Vec::load(x).store(b);
    for (int j = 0; j < W; ++j) {
      const c10::BFloat16 ref(x[j]);
      CHECK(b[j].x == ref.x || (std::isnan(x[j]) && std::isnan(static_cast<float>(b[j]))),
            "store bf16 %g: %04x vs %04x", x[j], b[j].x, ref.x);
    }
    Vec::load(b).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], static_cast<float>(b[j])), "load bf16");
    tmvec::round_to<c10::BFloat16>(Vec::load(x)).store(out);
    for (int j = 0; j < W; ++j)
      CHECK(same(out[j], static_cast<float>(c10::BFloat16(x[j]))), "round bf16 %g", x[j]);
    // fp16
    c10::Half h[W];
    Vec::load(x).store(h);
    for (int j = 0; j < W; ++j) {
      const c10::Half ref(x[j]);
      CHECK(h[j].x == ref.x || (std::isnan(x[j]) && std::isnan(static_cast<float>(h[j]))),
            "store half %g: %04x vs %04x", x[j], h[j].x, ref.x);
    }
    Vec::load(h).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], static_cast<float>(h[j])), "load half");
    tmvec::round_to<c10::Half>(Vec::load(x)).store(out);
    for (int j = 0; j < W; ++j)
      CHECK(same(out[j], static_cast<float>(c10::Half(x[j]))), "round half %g", x[j]);
  }

  // Arithmetic on finite values.
  for (int i = 0; i + 2 * W <= n; i += W) {
    float a[W], b[W], c[W], out[W];
    for (int j = 0; j < W; ++j) {
      a[j] = std::isfinite(xs[i + j]) ? xs[i + j] : 1.f;
      b[j] = std::isfinite(xs[i + W + j]) && xs[i + W + j] != 0.f ? xs[i + W + j] : 2.f;
      c[j] = static_cast<float>(j) - 1.5f;
    }
    const Vec va = Vec::load(a), vb = Vec::load(b), vc = Vec::load(c);
    (va + vb).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], a[j] + b[j]), "add");
    (va - vb).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], a[j] - b[j]), "sub");
    (va * vb).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], a[j] * b[j]), "mul");
    (va / vb).store(out);
    for (int j = 0; j < W; ++j) CHECK(same(out[j], a[j] / b[j]), "div");
    tmvec::fma(va, vb, vc).store(out);
    for (int j = 0; j < W; ++j) {
      const double ref = static_cast<double>(a[j]) * b[j] + c[j];
      if (std::fabs(ref) > std::numeric_limits<float>::max()) continue;  // overflows fp32
      CHECK(std::fabs(out[j] - ref) <= 1e-6 * std::fabs(static_cast<double>(a[j]) * b[j]) + 1e-6,
            "fma %g*%g+%g = %g", a[j], b[j], c[j], out[j]);
    }
    tmvec::max(va, vb).store(out);
    for (int j = 0; j < W; ++j) CHECK(out[j] == std::max(a[j], b[j]), "max");
    tmvec::min(va, vb).store(out);
    for (int j = 0; j < W; ++j) CHECK(out[j] == std::min(a[j], b[j]), "min");
    double sum = 0;
    float mx = -inf;
    for (int j = 0; j < W; ++j) sum += a[j], mx = std::max(mx, a[j]);
    double mag = 0;
    for (int j = 0; j < W; ++j) mag += std::fabs(a[j]);
    CHECK(std::fabs(tmvec::reduce_add(va) - sum) <= 1e-6 * mag + 1e-30, "reduce_add");
    CHECK(tmvec::reduce_max(va) == mx, "reduce_max");
    // reduce_add4: each of four registers' sums in its own slot (a, b, c, a + b)
    float four[4];
    const Vec regs[4] = {va, vb, vc, va + vb};
    tmvec::reduce_add4(regs[0], regs[1], regs[2], regs[3], four);
    for (int r = 0; r < 4; ++r) {
      float lanes[W];
      regs[r].store(lanes);
      double want = 0, size = 0;
      for (int j = 0; j < W; ++j) want += lanes[j], size += std::fabs(lanes[j]);
      CHECK(std::fabs(four[r] - want) <= 1e-6 * size + 1e-30, "reduce_add4 slot %d", r);
    }
  }

  // Partial loads and stores touch only their n lanes.
  for (int k = 0; k <= W; ++k) {
    float src[W], dst[W + 1];
    for (int j = 0; j < W; ++j) src[j] = static_cast<float>(j + 1);
    for (int j = 0; j <= W; ++j) dst[j] = -7.f;
    float got[W];
    Vec::load_n(src, k).store(got);
    for (int j = 0; j < W; ++j) CHECK(got[j] == (j < k ? src[j] : 0.f), "load_n %d lane %d", k, j);
    Vec::set1(3.f).store_n(dst, k);
    for (int j = 0; j <= W; ++j) CHECK(dst[j] == (j < k ? 3.f : -7.f), "store_n %d lane %d", k, j);
  }

  // exp: close to libm's in relative terms where the result is a normal float.
  for (float x = -87.f; x <= 88.f; x += 0.0137f) {
    float in[W], out[W];
    for (int j = 0; j < W; ++j) in[j] = x + j * 0.003f;
    tmvec::exp(Vec::load(in)).store(out);
    for (int j = 0; j < W; ++j) {
      const double ref = std::exp(static_cast<double>(in[j]));
      CHECK(std::fabs(out[j] - ref) <= 4e-7 * ref, "exp(%g) = %g vs %g", in[j], out[j], ref);
    }
  }
  {
    float in[W], out[W];
    for (int j = 0; j < W; ++j) in[j] = j % 2 ? -inf : -100.f;
    tmvec::exp(Vec::load(in)).store(out);
    for (int j = 0; j < W; ++j) CHECK(out[j] == 0.f, "exp(%g) = %g, want 0", in[j], out[j]);
    in[0] = 0.f;
    tmvec::exp(Vec::load(in)).store(out);
    CHECK(out[0] == 1.f, "exp(0) = %g", out[0]);
  }

  // Packed bf16 pairs: dword i = (lo_i, hi_i).
  {
    uint16_t packed[2 * W];
    for (int j = 0; j < W; ++j) {
      packed[2 * j] = c10::BFloat16(static_cast<float>(j) + 0.5f).x;
      packed[2 * j + 1] = c10::BFloat16(-static_cast<float>(j) * 3.f).x;
    }
    Vec lo, hi;
    tmvec::load_bf16_pairs(packed, lo, hi);
    float l[W], hh[W];
    lo.store(l);
    hi.store(hh);
    for (int j = 0; j < W; ++j) {
      CHECK(l[j] == static_cast<float>(j) + 0.5f, "pairs lo %d: %g", j, l[j]);
      CHECK(hh[j] == -static_cast<float>(j) * 3.f, "pairs hi %d: %g", j, hh[j]);
    }
  }

  // Integer codes: W bytes widened to fp32 lanes; 4-bit pairs split into nibbles. Every
  // byte value, read from a buffer that ends right after the W bytes (no over-read
  // under a sanitizer; the widened lanes must not see a neighbour's byte).
  for (int base = 0; base < 256; base += W) {
    std::vector<uint8_t> buf(W);
    for (int j = 0; j < W; ++j) buf[j] = static_cast<uint8_t>((base + j * 37) & 0xff);
    float got[W], lo_out[W], hi_out[W];
    tmvec::load_u8(buf.data()).store(got);
    Vec lo, hi;
    tmvec::load_u4_pairs(buf.data(), lo, hi);
    lo.store(lo_out);
    hi.store(hi_out);
    for (int j = 0; j < W; ++j) {
      CHECK(got[j] == static_cast<float>(buf[j]), "load_u8 lane %d: %g vs %d", j, got[j], buf[j]);
      CHECK(lo_out[j] == static_cast<float>(buf[j] & 0xf), "u4 lo lane %d: %g", j, lo_out[j]);
      CHECK(hi_out[j] == static_cast<float>(buf[j] >> 4), "u4 hi lane %d: %g", j, hi_out[j]);
    }
  }

  std::printf("vec.h W=%d: %d failures\n", W, failures);
  return failures > 100 ? 100 : failures;
}
