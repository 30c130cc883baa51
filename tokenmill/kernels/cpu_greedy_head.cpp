// Greedy tokens straight from the lm_head, screening the vocabulary in int8.
//
// Why: a batch-1 decode step is bound by streaming weights from memory, and the
// lm_head is about 40% of them. A greedy row needs only the argmax of its
// logits, so it reads an int8 copy of the lm_head (half the bytes) to get
// approximate logits with a rigorous error bound, and recomputes exactly, with
// linear_bf16's own code, only the 32-column blocks that can hold the maximum.
// The token is the one argmax over linear_bf16's logits picks (the lowest index
// among equal logits, the first NaN if any), bit for bit.
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
#include <ATen/Parallel.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif


namespace {

constexpr int64_t QB = 64;     // int8 columns per block: 64 columns x 2 k per 128 bytes
constexpr int64_t NB = 32;     // linear_bf16's packed column block
constexpr int64_t PCH = 512;   // k pairs per int32 sum: 1024 * 127 * 16383 < 2^31
constexpr int32_t XQ_MAX = 16383;

#if defined(__AVX512F__)
inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// Approximate dot products of R rows with one int8 block [KP, 64, 2]: out[r][j] =
// sum_k xq[r, k] q[k, j] (exact within each int32 chunk). xp: R rows of KP int16
// pairs, ldx pairs apart.
template <int R>
inline void screen_block(const uint32_t* xp, int64_t ldx, const int8_t* qb, int64_t KP,
                         float* out) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * QB + 16 * j, _mm512_setzero_ps());
  for (int64_t p0 = 0; p0 < KP; p0 += PCH) {
    const int64_t p1 = std::min(KP, p0 + PCH);
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* line = qb + p * 2 * QB;
      // Bound by memory at few rows: keep lines ~8 KB ahead in flight.
      _mm_prefetch(reinterpret_cast<const char*>(line + 64 * 2 * QB), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(line + 64 * 2 * QB + 64), _MM_HINT_T0);
      __m512i w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * j)));
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[r * ldx + p]));
        for (int j = 0; j < 4; ++j) acc[r][j] = dot_pairs(acc[r][j], w[j], xv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) {
        float* o = out + r * QB + 16 * j;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_cvtepi32_ps(acc[r][j])));
      }
  }
}

inline void screen_rows(const uint32_t* xp, int64_t KP, const int8_t* qb, int64_t rows,
                        float* out) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) screen_block<4>(xp + m * KP, KP, qb, KP, out + m * QB);
  switch (rows - m) {
    case 3: screen_block<3>(xp + m * KP, KP, qb, KP, out + m * QB); break;
    case 2: screen_block<2>(xp + m * KP, KP, qb, KP, out + m * QB); break;
    case 1: screen_block<1>(xp + m * KP, KP, qb, KP, out + m * QB); break;
    default: break;
  }
}
#endif

// torch.argmax's order: the first NaN wins, else the first of the largest values.
inline bool better(float v, float best, bool have) {
  if (!have) return true;
  if (std::isnan(best)) return false;
  return std::isnan(v) || v > best;
}

}  // namespace

// x [M, K] fp32 or bf16 (M <= 128: one linear_bf16 cache block), packed from
// pack_bf16_weight, q [ceil(N/64), ceil(K/2), 64, 2] int8, scale / coef / l1w
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
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == NB &&
                  packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "greedy_lm_head: weights must come from pack_bf16_weight");
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
#if defined(__AVX512F__)
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
    // Pass 1: every column's upper bound; each thread's largest lower bound per row.
    std::vector<double> upper(M * nq * QB);
    const int nthreads = at::get_num_threads();
    std::vector<double> lower_max(nthreads * M, -std::numeric_limits<double>::infinity());
    const auto* qp = q.data_ptr<int8_t>();
    const float* sp = scale.data_ptr<float>();
    const float* cp = coef.data_ptr<float>();
    const float* wp1 = l1w.data_ptr<float>();
    at::parallel_for(0, nq, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> acc(M * QB);
      double* lmax = lower_max.data() + at::get_thread_num() * M;
      for (int64_t b = b0; b < b1; ++b) {
        screen_rows(xpairs.data(), KP, qp + b * KP * 2 * QB, M, acc.data());
        const int64_t n0 = b * QB, ncols = std::min(QB, N - n0);
        for (int64_t m = 0; m < M; ++m) {
          const __m512d sxv = _mm512_set1_pd(sx[m]), l1v = _mm512_set1_pd(l1[m]);
          const __m512d hx = _mm512_set1_pd(0.5001 * sx[m]);
          // (1 + 2^-30): room for this double arithmetic's own rounding.
          const __m512d slack = _mm512_set1_pd(1.0 + 0x1p-30);
          __m512d lo_max = _mm512_set1_pd(lmax[m]);
          double* up = upper.data() + m * nq * QB + n0;
          for (int64_t j = 0; j < ncols; j += 8) {
            const __mmask8 valid =
                ncols - j >= 8 ? 0xff : static_cast<__mmask8>((1u << (ncols - j)) - 1);
            const __m512d a = _mm512_mul_pd(
                _mm512_cvtps_pd(_mm256_loadu_ps(acc.data() + m * QB + j)),
                _mm512_mul_pd(sxv, _mm512_cvtps_pd(_mm256_loadu_ps(sp + n0 + j))));
            const __m512d err = _mm512_mul_pd(
                _mm512_add_pd(_mm512_mul_pd(l1v, _mm512_cvtps_pd(_mm256_loadu_ps(cp + n0 + j))),
                              _mm512_mul_pd(hx, _mm512_cvtps_pd(_mm256_loadu_ps(wp1 + n0 + j)))),
                slack);
            _mm512_storeu_pd(up + j, _mm512_add_pd(a, err));
            // max(lo, lo_max) keeps lo_max where lo is NaN.
            lo_max = _mm512_mask_max_pd(lo_max, valid, _mm512_sub_pd(a, err), lo_max);
          }
          lmax[m] = _mm512_reduce_max_pd(lo_max);
        }
      }
    });
    // Pass 2: the 32-column blocks holding a column whose upper bound reaches the
    // threshold. `not less than`: a NaN bound keeps its block.
    for (int64_t m = 0; m < M; ++m) {
      double L = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < nthreads; ++t) L = std::max(L, lower_max[t * M + m]);
      const double threshold = std::isfinite(L) ? L - std::fabs(L) * 0x1p-6 - 1e-37
                                                : -std::numeric_limits<double>::infinity();
      const __m512d tv = _mm512_set1_pd(threshold);
      const double* up = upper.data() + m * nq * QB;
      for (int64_t b = 0; b < nb32; ++b) {
        const int64_t ncols = std::min(NB, N - b * NB);
        __mmask8 hit = 0;
        for (int64_t j = 0; j < ncols; j += 8) {
          const __mmask8 valid =
              ncols - j >= 8 ? 0xff : static_cast<__mmask8>((1u << (ncols - j)) - 1);
          hit |= _mm512_mask_cmp_pd_mask(valid, _mm512_loadu_pd(up + b * NB + j), tv, _CMP_NLT_UQ);
        }
        candidate[b] |= static_cast<uint8_t>(hit != 0);
      }
    }
  }
  std::vector<int64_t> blocks;
  for (int64_t b = 0; b < nb32; ++b)
    if (candidate[b]) blocks.push_back(b);
  // Pass 3: those blocks exactly, for all M rows together (linear_bf16's arithmetic
  // for a block depends on its row count), then argmax in column order.
  const int64_t nc = static_cast<int64_t>(blocks.size());
  std::vector<float> exact(nc * M * NB);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  at::parallel_for(0, nc, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = blocks[i], ncols = std::min(NB, N - b * NB);
      linear_bf16_block(xf.data(), K, wp + b * K * NB, exact.data() + i * M * NB, NB, M, ncols);
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
#else
  TORCH_CHECK(false, "greedy_lm_head needs AVX-512: this is the ", TOKENMILL_CPU_LEVEL_NAME,
              " build of the kernels (tokenmill.kernels.cpu_ops)");
  return {ids, 0};
#endif
}
