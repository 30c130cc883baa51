// Checks the int8 screen of tokenmill/kernels/cpu_greedy_head.cpp (its per-ISA inner
// loop, without ATen) against plain int64 sums, bit for bit, for whichever ISA the
// compiler flags select: tests/unit/test_greedy_head.py builds it once per capability
// level, on the plain-array fallback and for aarch64 under qemu. Every row count up
// to 9 (each ISA's row blocks and their tails), one to three int32 chunks, and the
// largest |q| x |xq| products on a whole chunk (the int32 limit the chunking keeps).
// Prints the ISA and the number of failures; the exit status is that number (max 100).
#define TM_GREEDY_SCREEN_ONLY 1
#include "../../tokenmill/kernels/cpu_greedy_head.cpp"

#include <cstdio>
#include <random>

int main() {
  std::mt19937 rng(99);
  int failures = 0;
  for (const int64_t KP : {int64_t{1}, int64_t{7}, int64_t{64}, PCH, PCH + 3, 2 * PCH + 40}) {
    for (int extreme = 0; extreme < 2; ++extreme) {
      constexpr int64_t kRows = 9;
      std::vector<int8_t> q(KP * 2 * QB);
      std::vector<int16_t> xq(kRows * KP * 2);
      std::uniform_int_distribution<int> qd(-127, 127), xd(-XQ_MAX, XQ_MAX), sign(0, 1);
      for (auto& v : q) v = static_cast<int8_t>(extreme ? (sign(rng) ? 127 : -127) : qd(rng));
      for (auto& v : xq) v = static_cast<int16_t>(extreme ? XQ_MAX : xd(rng));
      if (extreme) {  // every product of row 0, column 0 at +127 * 16383: the chunk's max sum
        for (int64_t p = 0; p < KP; ++p) q[p * 2 * QB] = q[p * 2 * QB + 1] = 127;
      }
      std::vector<uint32_t> xp(kRows * KP);
      std::memcpy(xp.data(), xq.data(), xp.size() * sizeof(uint32_t));
      for (int64_t rows = 1; rows <= kRows; ++rows) {
        std::vector<float> out(rows * QB, -1.f);
        screen_rows(xp.data(), KP, q.data(), rows, out.data());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < QB; ++j) {
            float ref = 0.f;
            for (int64_t p0 = 0; p0 < KP; p0 += PCH) {
              int64_t s = 0;
              for (int64_t p = p0; p < std::min(KP, p0 + PCH); ++p)
                for (int h = 0; h < 2; ++h)
                  s += int64_t{q[p * 2 * QB + 2 * j + h]} * xq[(r * KP + p) * 2 + h];
              if (s > INT32_MAX || s < INT32_MIN) std::printf("FAIL chunk sum %lld\n", (long long)s);
              ref += static_cast<float>(s);
            }
            if (std::memcmp(&ref, &out[r * QB + j], sizeof(float)) != 0 && ++failures <= 20)
              std::printf("FAIL KP=%lld rows=%lld r=%lld j=%lld: %.9g vs %.9g\n", (long long)KP,
                          (long long)rows, (long long)r, (long long)j, out[r * QB + j], ref);
          }
      }
    }
  }
  std::printf("screen=%s I=%d rows=%d: %d failures\n", TM_SCREEN_ISA, Screen::I, Screen::kMaxRows,
              failures);
  return std::min(failures, 100);
}
