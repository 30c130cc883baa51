// Gated DeltaNet's delta rule on the CPU (Qwen3.5 / Qwen3-Next linear-attention
// layers): the recurrence token by token, for every sequence of a call (a prompt chunk,
// a batch of decode rows) over its own state slot.
//
// Per value head and token, with a = exp(g), k and q L2-normalised (q scaled) -- by the
// caller (gated_delta_rule) or here (gated_delta_rule_qkv) -- and the state S [Dv, Dk]
// (the cache's layout: row i is value channel i):
//   S <- a S;  u = beta (v - S k);  S <- S + u k^T;  o = S q.
// Row s_i of S evolves alone. With d_k = s_i . k and d_q = s_i . q taken on the row as
// the token finds it:
//   u_i = beta (v_i - a d_k),   o_i = a d_q + u_i (k . q),   s_i <- a s_i + u_i k,
// which is the same arithmetic regrouped (S q after the update, expanded). So a token
// is one pass over the rows, each read and written once, and a head's rows split
// freely between threads. Two forms of that pass:
// - run_rows (decode rows, short sequences): each row's Dk floats in vectors, its two
//   dot products reduced together;
// - run_lanes (prompt chunks): W rows across the lanes of a vector, the block held
//   transposed in L1 for the whole sequence, so the dot products need no horizontal
//   reduction and u, o are vectors (~4x fewer cycles a row and token).
//
// Why not the chunked form of the GPU kernels: a token and head cost ~4 Dk Dv flops
// here, on rows that stay in L1 across the tokens (a block of kRowBlock rows of Dk
// floats), while the chunked form's many small matrix products, triangular solve and
// copies cost far more than that on a CPU (PyTorch's: ~120 ms a layer for a
// 2,000-token prompt at 8 heads of 64 x 64 on 2 cores, where this takes a few).
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "state_slots.h"
#include "vec.h"

namespace {

using tmvec::Vec;
constexpr int W = Vec::W;
constexpr int64_t kRowBlock = 16;  // rows of a head's state per job

// One call's inputs: q, k, v in T (fp32 ones the caller prepared, or the layer's conv
// output itself), g and beta fp32. With `inv` (the layer's tensors), a token's q and k
// heads are scaled by their inverse norms ([T][2 Hk]: q heads', then k heads') and q
// by q_scale as each job reads them.
template <typename T>
struct Args {
  const T *q, *k, *v;
  const float *g, *beta;
  const float* inv;  // nullptr: q and k as they are
  float q_scale;
  int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head, g_tok, g_head, b_tok, b_head, inv_tok;
  float* out;
  int64_t o_tok, o_head;
  int64_t rep, hk, dk;  // value heads per q/k head; Hk; Dk
};

// a . b over n floats
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc = Vec::zero();
  int64_t x = 0;
  for (; x + W <= n; x += W) acc = tmvec::fma(Vec::load(a + x), Vec::load(b + x), acc);
  float sum = tmvec::reduce_add(acc);
  for (; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

// Token t's key and query of q/k head `kh` into kf, qf (Dk floats each) as the rule
// takes them: fp32, normalised (x times its inverse norm, then q times q_scale: the
// PyTorch path's two roundings) where the call has the norms.
template <typename T>
inline void load_qk(const Args<T>& a, int64_t t, int64_t kh, float* kf, float* qf) {
  const T* k = a.k + t * a.k_tok + kh * a.k_head;
  const T* q = a.q + t * a.q_tok + kh * a.q_head;
  const int64_t dk = a.dk;
  float ks = 1.f, qs = 1.f, sc = 1.f;
  if (a.inv != nullptr) {
    qs = a.inv[t * a.inv_tok + kh];
    ks = a.inv[t * a.inv_tok + a.hk + kh];
    sc = a.q_scale;
  }
  const Vec vk = Vec::set1(ks), vq = Vec::set1(qs), vs = Vec::set1(sc);
  int64_t x = 0;
  for (; x + W <= dk; x += W) {
    (Vec::load(k + x) * vk).store(kf + x);
    ((Vec::load(q + x) * vq) * vs).store(qf + x);
  }
  for (; x < dk; ++x) {
    kf[x] = static_cast<float>(k[x]) * ks;
    qf[x] = static_cast<float>(q[x]) * qs * sc;
  }
}

// The first n (<= W) values at p as a vector, the rest zero.
template <typename T>
inline Vec load_first(const T* p, int64_t n) {
  if (n == W) return Vec::load(p);
  alignas(64) float tmp[W] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::load(tmp);
}

// Rows [r0, r1) of value head h, state rows at s (Dk floats apart), tokens [t0, t1);
// kf, qf: Dk floats each of scratch.
template <typename T>
void run_rows(const Args<T>& a, int64_t h, int64_t t0, int64_t t1, float* s, int64_t r0,
              int64_t r1, float* kf, float* qf) {
  const int64_t dk = a.dk, hk = h / a.rep;
  for (int64_t t = t0; t < t1; ++t) {
    load_qk(a, t, hk, kf, qf);
    const float *k = kf, *q = qf;
    const T* v = a.v + t * a.v_tok + h * a.v_head;
    float* o = a.out + t * a.o_tok + h * a.o_head;
    const float decay = std::exp(a.g[t * a.g_tok + h * a.g_head]);
    const float beta = a.beta[t * a.b_tok + h * a.b_head];
    const float kq = dot(k, q, dk);
    const Vec vdecay = Vec::set1(decay);
    // Two rows a step: their four dot products reduced in one go.
    for (int64_t i = r0; i < r1; i += 2) {
      const bool two = i + 1 < r1;
      float* s0 = s + i * dk;
      float* s1 = two ? s0 + dk : s0;  // (a lone last row is reduced twice, kept once)
      Vec k0 = Vec::zero(), q0 = Vec::zero(), k1 = Vec::zero(), q1 = Vec::zero();
      int64_t x = 0;
      for (; x + W <= dk; x += W) {
        const Vec kv = Vec::load(k + x), qv = Vec::load(q + x);
        const Vec a0 = Vec::load(s0 + x), a1 = Vec::load(s1 + x);
        k0 = tmvec::fma(a0, kv, k0);
        q0 = tmvec::fma(a0, qv, q0);
        k1 = tmvec::fma(a1, kv, k1);
        q1 = tmvec::fma(a1, qv, q1);
      }
      float d[4];
      tmvec::reduce_add4(k0, q0, k1, q1, d);
      for (int64_t y = x; y < dk; ++y) {
        d[0] += s0[y] * k[y];
        d[1] += s0[y] * q[y];
        d[2] += s1[y] * k[y];
        d[3] += s1[y] * q[y];
      }
      const float u0 = beta * (static_cast<float>(v[i]) - decay * d[0]);
      const float u1 = two ? beta * (static_cast<float>(v[i + 1]) - decay * d[2]) : 0.f;
      o[i] = decay * d[1] + u0 * kq;
      if (two) o[i + 1] = decay * d[3] + u1 * kq;
      const Vec uv0 = Vec::set1(u0), uv1 = Vec::set1(u1);
      x = 0;
      for (; x + W <= dk; x += W) {
        const Vec kv = Vec::load(k + x);
        tmvec::fma(Vec::load(s0 + x), vdecay, uv0 * kv).store(s0 + x);
        if (two) tmvec::fma(Vec::load(s1 + x), vdecay, uv1 * kv).store(s1 + x);
      }
      for (; x < dk; ++x) {
        s0[x] = s0[x] * decay + u0 * k[x];
        if (two) s1[x] = s1[x] * decay + u1 * k[x];
      }
    }
  }
}

// Sequences of at least this many tokens take run_lanes (its transposes cost about a
// token's work each way); shorter ones (decode rows) run_rows.
constexpr int64_t kLanesMinTokens = 4;

// Rows [r0, r0 + n) (n <= W) of value head h across the lanes of one vector: the block
// is held transposed in `st` ([Dk][W], row i in lane i), so each token is one pass of
// broadcast k[x] / q[x] times a vector of rows -- no horizontal reductions, and u and o
// are vectors over the rows. The pass that updates the rows for token t also takes
// the dot products token t + 1 needs (of the updated rows), four partial sums each.
// qk: 4 Dk floats of scratch (two tokens' fp32 key and query).
template <typename T>
void run_lanes(const Args<T>& a, int64_t h, int64_t t0, int64_t t1, float* s, int64_t r0,
               int64_t n, float* st, float* qk) {
  const int64_t dk = a.dk, hk = h / a.rep;
  for (int64_t x = 0; x < dk; ++x)
    for (int64_t i = 0; i < W; ++i) st[x * W + i] = i < n ? s[(r0 + i) * dk + x] : 0.f;
  float* kb[2] = {qk, qk + 2 * dk};  // token t's in slot (t - t0) % 2
  float* qb[2] = {qk + dk, qk + 3 * dk};
  // The pass over the block for one token: with `u`, the rows become a s + u k (k, the
  // token's key); then (either way) the dot products of the rows with k1 and q1 (the
  // next token's key and query), four partial sums each (four shorter chains).
  Vec dkv, dqv;
  auto pass = [&](const float* k, const Vec* u, Vec vdecay, const float* k1, const float* q1) {
    Vec k0 = Vec::zero(), k1s = Vec::zero(), q0 = Vec::zero(), q1s = Vec::zero();
    Vec k2 = Vec::zero(), k3 = Vec::zero(), q2 = Vec::zero(), q3 = Vec::zero();
    int64_t x = 0;
    auto step = [&](int64_t x, Vec& ka, Vec& qa) {
      Vec sx = Vec::load(st + x * W);
      if (u != nullptr) {
        sx = tmvec::fma(sx, vdecay, Vec::set1(k[x]) * *u);
        sx.store(st + x * W);
      }
      ka = tmvec::fma(Vec::set1(k1[x]), sx, ka);
      qa = tmvec::fma(Vec::set1(q1[x]), sx, qa);
    };
    for (; x + 4 <= dk; x += 4) {
      step(x, k0, q0);
      step(x + 1, k1s, q1s);
      step(x + 2, k2, q2);
      step(x + 3, k3, q3);
    }
    for (; x < dk; ++x) step(x, k0, q0);
    dkv = (k0 + k1s) + (k2 + k3);
    dqv = (q0 + q1s) + (q2 + q3);
  };
  load_qk(a, t0, hk, kb[0], qb[0]);
  pass(nullptr, nullptr, Vec::zero(), kb[0], qb[0]);  // the rows as they come in
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t cur = (t - t0) & 1;
    const float *k = kb[cur], *q = qb[cur];
    const T* v = a.v + t * a.v_tok + h * a.v_head + r0;
    float* o = a.out + t * a.o_tok + h * a.o_head + r0;
    const float decay = std::exp(a.g[t * a.g_tok + h * a.g_head]);
    const float beta = a.beta[t * a.b_tok + h * a.b_head];
    const float kq = dot(k, q, dk);
    const Vec vdecay = Vec::set1(decay);
    const Vec u = Vec::set1(beta) * (load_first(v, n) - vdecay * dkv);
    const Vec out = tmvec::fma(u, Vec::set1(kq), vdecay * dqv);
    if (n == W) {
      out.store(o);
    } else {
      out.store_n(o, static_cast<int>(n));
    }
    if (t + 1 < t1) {
      load_qk(a, t + 1, hk, kb[cur ^ 1], qb[cur ^ 1]);
      pass(k, &u, vdecay, kb[cur ^ 1], qb[cur ^ 1]);
    } else {  // (after the last token the dot products go unused)
      pass(k, &u, vdecay, k, q);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t x = 0; x < dk; ++x) s[(r0 + i) * dk + x] = st[x * W + i];
}

// Every (sequence, value head, row block) of the call as a job: the rule over rows of
// the state `st` ([S, Hv, Dv, Dk]) for the inputs `a`.
template <typename T>
void run_sequences(const Args<T>& a, float* st, const tmstate::Sequences& sq, int64_t hv,
                   int64_t dv) {
  const int64_t n = sq.n, dk = a.dk;
  const int64_t *cu = sq.cu, *rd = sq.rd, *wr = sq.wr;
  // Row blocks of kRowBlock rows, or of W (one vector of rows) where a sequence is long
  // enough for run_lanes: a step of decode rows has one kind, a prompt chunk the other.
  bool lanes = false;
  for (int64_t i = 0; i < n && !lanes; ++i) lanes = cu[i + 1] - cu[i] >= kLanesMinTokens;
  const int64_t block = lanes ? W : kRowBlock;
  const int64_t blocks = (dv + block - 1) / block;
  const int64_t head_floats = dv * dk;
  // (rounded up to whole vectors: the key / query rows after the transposed block stay
  // 64-byte aligned)
  const int64_t dk_padded = (dk + W - 1) / W * W;
  tmpar::parallel_for(0, n * hv * blocks, 1, [&](int64_t j0, int64_t j1) {
    // (64-byte aligned: a vector row that straddles two cache lines is a split load
    // and store each pass)
    std::vector<float, tmamx::Aligned64<float>> scratch((lanes ? dk * W : 0) + 4 * dk_padded);
    float* qk = scratch.data() + (lanes ? dk * W : 0);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t seq = j / (hv * blocks), h = j / blocks % hv, b = j % blocks;
      const int64_t r0 = b * block, r1 = std::min(dv, r0 + block);
      float* s = st + (wr[seq] * hv + h) * head_floats;
      if (rd[seq] != wr[seq])  // this job's rows into the written slot first
        std::memcpy(s + r0 * dk, st + (rd[seq] * hv + h) * head_floats + r0 * dk,
                    (r1 - r0) * dk * sizeof(float));
      if (cu[seq + 1] - cu[seq] >= kLanesMinTokens) {
        run_lanes(a, h, cu[seq], cu[seq + 1], s, r0, r1 - r0, scratch.data(), qk);
      } else {
        for (int64_t q0 = r0; q0 < r1; q0 += kRowBlock)
          run_rows(a, h, cu[seq], cu[seq + 1], s, q0, std::min(r1, q0 + kRowBlock), qk,
                   qk + dk_padded);
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name, int64_t tokens, int64_t heads,
                int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "gated_delta_rule: ", name, " must be float32");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(1) == heads && t.size(2) == dim &&
                  (dim <= 1 || t.stride(2) == 1),
              "gated_delta_rule: ", name, " must be [", tokens, ", ", heads, ", ", dim,
              "] with contiguous rows, got ", t.sizes());
}

// state [S, Hv, Dv, Dk] fp32 contiguous, checked against the heads and sizes.
void check_state(const torch::Tensor& state, int64_t hv, int64_t dv, int64_t dk,
                 const char* what) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(1) == hv && state.size(2) == dv && state.size(3) == dk,
              what, ": state must be contiguous float32 [S, ", hv, ", ", dv, ", ", dk,
              "], got ", state.scalar_type(), " ", state.sizes());
}

// One token's per-head values from the layer's conv output row and gate inputs: the
// inverse L2 norms of its q and k heads (eps 1e-6, as the PyTorch path's l2_normalize),
// and per value head g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b)
// (softplus: x past 20 is x, as F.softplus).
template <typename T>
void prepare_token(const T* row, const T* a, int64_t a_head, const T* b, int64_t b_head,
                   const float* a_log, const float* dt_bias, int64_t hk, int64_t hv,
                   int64_t dk, float* inv, float* g, float* beta) {
  for (int64_t h = 0; h < 2 * hk; ++h) {  // q heads, then k heads
    const T* x = row + h * dk;
    Vec acc = Vec::zero();
    int64_t i = 0;
    for (; i + W <= dk; i += W) {
      const Vec v = Vec::load(x + i);
      acc = tmvec::fma(v, v, acc);
    }
    float sum = tmvec::reduce_add(acc);
    for (; i < dk; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
    inv[h] = 1.f / std::sqrt(sum + 1e-6f);
  }
  for (int64_t h = 0; h < hv; ++h) {
    const float x = static_cast<float>(a[h * a_head]) + dt_bias[h];
    g[h] = -std::exp(a_log[h]) * (x > 20.f ? x : std::log1p(std::exp(x)));
    beta[h] = 1.f / (1.f + std::exp(-static_cast<float>(b[h * b_head])));
  }
}

}  // namespace

// q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] (fp32, any token / head strides);
// state [S, Hv, Dv, Dk] fp32 (contiguous). Sequence n is tokens [cu_seqlens[n],
// cu_seqlens[n + 1]): it starts from state[read_slots[n]] and leaves its final state in
// state[write_slots[n]] (the same slot: in place). No sequence may read a slot another
// writes. Returns the outputs [T, Hv, Dv] fp32.
torch::Tensor gated_delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor g, torch::Tensor beta, torch::Tensor state,
                               torch::Tensor cu_seqlens, torch::Tensor read_slots,
                               torch::Tensor write_slots) {
  TORCH_CHECK(v.dim() == 3, "gated_delta_rule: v must be [T, Hv, Dv]");
  const int64_t T = v.size(0), hv = v.size(1), dv = v.size(2);
  TORCH_CHECK(q.dim() == 3 && q.size(1) > 0 && hv % q.size(1) == 0,
              "gated_delta_rule: q must be [T, Hk, Dk] with Hk dividing Hv = ", hv);
  const int64_t hk = q.size(1), dk = q.size(2);
  check_rows(q, "q", T, hk, dk);
  check_rows(k, "k", T, hk, dk);
  check_rows(v, "v", T, hv, dv);
  for (const auto* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == hv,
                "gated_delta_rule: g and beta must be float32 [T, Hv]");
  check_state(state, hv, dv, dk, "gated_delta_rule");
  const tmstate::Sequences sq =
      tmstate::check_sequences(cu_seqlens, read_slots, write_slots, T, state.size(0),
                               "gated_delta_rule");
  auto out = torch::empty({T, hv, dv}, v.options());
  if (T == 0 || sq.n == 0) return out;
  const Args<float> a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                      g.data_ptr<float>(), beta.data_ptr<float>(), nullptr, 1.f,
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                      v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), 0,
                      out.data_ptr<float>(), out.stride(0), out.stride(1), hv / hk, hk, dk};
  run_sequences(a, state.data_ptr<float>(), sq, hv, dv);
  return out;
}

// The rule from a Gated DeltaNet layer's own tensors: mixed_qkv [T, 2 Hk Dk + Hv Dv] (the
// conv output, q | k | v, rows contiguous), a and b [T, Hv] (the decay and beta inputs,
// any strides), all one float dtype; A_log and dt_bias [Hv]. A first pass over the
// tokens takes the q / k norms, g and beta (prepare_token: a few floats a token); the
// jobs then read q, k, v where they are, normalising a token's key and query as they
// take it, instead of a dozen PyTorch ops a layer and an fp32 copy of q | k | v.
torch::Tensor gated_delta_rule_qkv(torch::Tensor mixed_qkv, torch::Tensor a, torch::Tensor b,
                                   torch::Tensor A_log, torch::Tensor dt_bias,
                                   torch::Tensor state, torch::Tensor cu_seqlens,
                                   torch::Tensor read_slots, torch::Tensor write_slots,
                                   int64_t num_k_heads, double q_scale) {
  const char* what = "gated_delta_rule_qkv";
  TORCH_CHECK(state.dim() == 4, what, ": state must be [S, Hv, Dv, Dk]");
  const int64_t hv = state.size(1), dv = state.size(2), dk = state.size(3), hk = num_k_heads;
  check_state(state, hv, dv, dk, what);
  TORCH_CHECK(hk > 0 && hv % hk == 0, what, ": num_k_heads must divide Hv = ", hv);
  const int64_t width = 2 * hk * dk + hv * dv;
  TORCH_CHECK(mixed_qkv.dim() == 2 && mixed_qkv.size(1) == width &&
                  (width <= 1 || mixed_qkv.stride(1) == 1),
              what, ": mixed_qkv must be [T, ", width, "] with contiguous rows, got ",
              mixed_qkv.sizes());
  const int64_t T = mixed_qkv.size(0);
  for (const auto* t : {&a, &b})
    TORCH_CHECK(t->scalar_type() == mixed_qkv.scalar_type() && t->dim() == 2 &&
                    t->size(0) == T && t->size(1) == hv,
                what, ": a and b must be [T, ", hv, "] in mixed_qkv's dtype");
  TORCH_CHECK(A_log.numel() == hv && dt_bias.numel() == hv, what,
              ": A_log and dt_bias must hold ", hv, " values");
  const auto a_log = A_log.to(at::kFloat).contiguous();
  const auto bias = dt_bias.to(at::kFloat).contiguous();
  const tmstate::Sequences sq =
      tmstate::check_sequences(cu_seqlens, read_slots, write_slots, T, state.size(0), what);
  auto f32 = mixed_qkv.options().dtype(at::kFloat);
  auto out = torch::empty({T, hv, dv}, f32);
  if (T == 0 || sq.n == 0) return out;
  const int64_t per_token = 2 * hk + 2 * hv;  // inverse norms, g, beta
  auto token_values = torch::empty({T, per_token}, f32);
  float* tv = token_values.data_ptr<float>();
  const float *al = a_log.data_ptr<float>(), *db = bias.data_ptr<float>();
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = mixed_qkv.data_ptr<scalar_t>();
    const scalar_t *ap = a.data_ptr<scalar_t>(), *bp = b.data_ptr<scalar_t>();
    const int64_t ld = mixed_qkv.stride(0);
    tmpar::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* row = tv + t * per_token;
        prepare_token<scalar_t>(xp + t * ld, ap + t * a.stride(0), a.stride(1),
                                bp + t * b.stride(0), b.stride(1), al, db, hk, hv, dk, row,
                                row + 2 * hk, row + 2 * hk + hv);
      }
    });
    const Args<scalar_t> args{xp, xp + hk * dk, xp + 2 * hk * dk, tv + 2 * hk,
                              tv + 2 * hk + hv, tv, static_cast<float>(q_scale),
                              ld, dk, ld, dk, ld, dv, per_token, 1, per_token, 1, per_token,
                              out.data_ptr<float>(), out.stride(0), out.stride(1), hv / hk,
                              hk, dk};
    run_sequences(args, state.data_ptr<float>(), sq, hv, dv);
  };
  switch (mixed_qkv.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": float32, bfloat16 or float16 only");
  }
  return out;
}
