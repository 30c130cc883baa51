// y = x @ w^T for a few rows x (decode steps) and bf16 weights w, fp32 accumulation.
//
// At batch 1-4 a linear layer is bound by reading its weights. oneDNN's bf16
// GEMM on CPUs without native bf16 is compute-bound (emulated), and an fp32
// copy of the weights doubles the bytes read. This kernel streams the bf16
// weights once, widening 16 at a time into fp32 registers (a bf16 is the top
// half of an fp32), and multiplies them with up to 4 rows of x held in fp32.
// Output columns are split over the intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 widen_bf16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 widen_bf16_masked(const c10::BFloat16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// ROWS rows of x (fp32, [ROWS, K]) against 4 weight rows starting at w (stride K).
template <int ROWS>
static inline void dot_4cols(const float* x, int64_t ldx, const c10::BFloat16* w, int64_t K,
                             float* out, int64_t ldo, int64_t ncols) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = c < ncols ? widen_bf16(w + c * K + k) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[4];
    for (int c = 0; c < 4; ++c)
      wv[c] = c < ncols ? widen_bf16_masked(w + c * K + k, m) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < ncols; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

// x [M, K] (fp32 or bf16), w [N, K] bf16, bias [N] or empty -> [M, N] in x's dtype.
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "gemv_bf16: w must be a contiguous [N, K] bf16 matrix");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: x must be [M, K]");
  const auto out_dtype = x.scalar_type();
  torch::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  torch::Tensor out = torch::empty({M, N}, xf.options());
#if defined(__AVX512F__)
  const float* xp = xf.data_ptr<float>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  float* op = out.data_ptr<float>();
  // Columns in groups of 4; a grain of 64 groups keeps each thread on a long stretch.
  const int64_t groups = (N + 3) / 4;
  at::parallel_for(0, groups, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * 4, ncols = std::min<int64_t>(4, N - n);
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m);
        const float* xr = xp + m * K;
        float* o = op + m * N + n;
        switch (rows) {
          case 4: dot_4cols<4>(xr, K, wp + n * K, K, o, N, ncols); break;
          case 3: dot_4cols<3>(xr, K, wp + n * K, K, o, N, ncols); break;
          case 2: dot_4cols<2>(xr, K, wp + n * K, K, o, N, ncols); break;
          default: dot_4cols<1>(xr, K, wp + n * K, K, o, N, ncols); break;
        }
      }
    }
  });
#else
  out = torch::matmul(xf, w.to(at::kFloat).t());
#endif
  if (bias.defined() && bias.numel() > 0) out.add_(bias.to(at::kFloat));
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}
