// min-p / top-k / top-p (nucleus) thresholds of a step's sampling logits [M, V], without
// a sort.
//
// The sort-based mask (sort each row, cumulative softmax, scatter back) took ~125 ms a
// step at 128 rows of a 32k vocabulary on two threads: more than the model's forward.
// Both cuts are a selection, not an order: top-k keeps the values at or above the k-th
// largest, top-p the values at or above the first one, from the top, at which the
// probability mass of the values so far (itself included) reaches p. A radix select
// finds either in three passes over ever fewer candidates: each pass histograms the
// next 11 / 11 / 10 bits of an order-preserving integer key of the value (counts for
// top-k, masses exp(x - max) for top-p) and walks the buckets from the top to the one
// where the running total reaches the target.
//
// min_p, applied first, is a threshold already: max + log(min_p) (a probability below
// min_p times the top one); top-k and top-p then count and weigh what it keeps.
//
// The result is a threshold per row, and the row masked in place: values below it go
// to -inf. Equal values are kept or dropped together (a sort kept an arbitrary part
// of a tie at the cut).
// Masses sum in double, by element order: a row's threshold does not depend on the
// thread count. NaN / inf rows get some threshold in range (their request fails on
// its NaN elsewhere); nothing reads out of bounds.
#include "ops.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using tmvec::Vec;

// float -> uint32 whose unsigned order is the float order (-NaN < -inf < ... < +inf <
// +NaN; -0 just below +0).
inline uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float key_value(uint32_t key) {
  const uint32_t u = (key & 0x80000000u) ? (key ^ 0x80000000u) : ~key;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Scratch {
  std::vector<uint32_t> keys, cand_keys, next_keys;
  std::vector<float> mass, cand_mass, next_mass;
};

// The passes' digits, from the top: 11 + 11 + 10 = 32 bits.
constexpr int kShift[3] = {21, 10, 0};
constexpr uint32_t kBuckets[3] = {2048, 2048, 1024};

// The largest key K among keys[0, n) such that the weight of the keys >= K reaches
// the target (weight: mass[i], or 1 each without masses; target: `target`, or that
// fraction of the total weight if `of_total`). Where no key reaches it (the target
// past the total by rounding), the smallest key of some weight; where no key has any
// weight (masses of a NaN / inf row), 0. n >= 1.
uint32_t select_key(Scratch& s, const uint32_t* keys, const float* mass, int64_t n,
                    double target, bool of_total) {
  double weight[2048];
  uint32_t count[2048];
  uint32_t prefix = 0;  // the bits chosen so far, in place
  const uint32_t* k = keys;
  const float* w = mass;
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level];
    const uint32_t buckets = kBuckets[level];
    if (w != nullptr) {
      std::memset(weight, 0, sizeof(double) * buckets);
      for (int64_t i = 0; i < n; ++i) weight[(k[i] >> shift) & (buckets - 1)] += w[i];
    } else {
      std::memset(count, 0, sizeof(uint32_t) * buckets);
      for (int64_t i = 0; i < n; ++i) ++count[(k[i] >> shift) & (buckets - 1)];
    }
    if (level == 0 && of_total) {
      double total = 0;
      for (uint32_t b = 0; b < buckets; ++b) total += weight[b];
      target *= total;
    }
    // From the top bucket down to the first where the running weight reaches the
    // target. Only a bucket of some weight is chosen: with masses, values of none
    // (below exp's range) are never needed to reach a target.
    double above = 0;
    int64_t pick = -1, lowest = -1;
    for (int64_t b = buckets - 1; b >= 0; --b) {
      const double here = w != nullptr ? weight[b] : static_cast<double>(count[b]);
      if (!(here > 0)) continue;
      lowest = b;
      if (above + here >= target) {
        pick = b;
        break;
      }
      above += here;
    }
    if (lowest < 0) return 0;  // no weight at all (a NaN / inf row): the smallest key
    if (pick < 0) {  // never reached: keep all, down to the smallest key of weight
      pick = lowest;
      target = std::numeric_limits<double>::infinity();  // (and so at every later level)
    } else {
      target -= above;
    }
    prefix |= static_cast<uint32_t>(pick) << shift;
    if (level == 2) break;
    // The candidates of the picked bucket, for the next level.
    const uint32_t hi_mask = ~((1u << shift) - 1);  // the bits fixed so far
    std::vector<uint32_t>& nk = (k == s.cand_keys.data()) ? s.next_keys : s.cand_keys;
    std::vector<float>& nm = (k == s.cand_keys.data()) ? s.next_mass : s.cand_mass;
    if (nk.size() < static_cast<size_t>(n)) nk.resize(n);
    if (w != nullptr && nm.size() < static_cast<size_t>(n)) nm.resize(n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      if ((k[i] & hi_mask) == prefix) {
        nk[m] = k[i];
        if (w != nullptr) nm[m] = w[i];
        ++m;
      }
    }
    n = m;
    k = nk.data();
    w = w != nullptr ? nm.data() : nullptr;
  }
  return prefix;
}

float row_threshold(Scratch& s, const float* x, int64_t V, int64_t top_k, float top_p,
                    float min_p) {
  const bool use_k = top_k > 0 && top_k < V;
  const bool use_p = top_p < 1.f;    // (NaN: no cut)
  const bool use_min = min_p > 0.f;  // (NaN: no cut)
  if (!use_k && !use_p && !use_min) return -std::numeric_limits<float>::infinity();
  float max_x = -std::numeric_limits<float>::infinity();
  if (use_p || use_min) {
    for (int64_t j = 0; j < V; ++j) max_x = x[j] > max_x ? x[j] : max_x;
  }
  uint32_t cut = 0;  // the smallest key kept
  // min_p: a probability below min_p times the top one, exp(x - max) < min_p, is
  // x < max + log(min_p); the cuts after it only raise the threshold.
  if (use_min) cut = order_key(max_x + std::log(min_p));
  if (!use_k && !use_p) return key_value(cut);
  s.keys.resize(V);
  uint32_t* keys = s.keys.data();
  for (int64_t j = 0; j < V; ++j) keys[j] = order_key(x[j]);
  if (use_k) {
    // (the k-th largest of the row; where min_p kept fewer than k values, its cut is
    // the higher one, as a k-th largest of -inf would keep all min_p kept)
    const uint32_t cut_k = select_key(s, keys, nullptr, V, static_cast<double>(top_k), false);
    cut = cut_k > cut ? cut_k : cut;
  }
  if (use_p) {
    // Masses exp(x - max) of the values min_p and top-k keep, 0 for the others.
    s.mass.resize(V);
    float* mass = s.mass.data();
    const Vec shift = Vec::set1(max_x);
    const int64_t full = V - V % Vec::W;
    for (int64_t j = 0; j < full; j += Vec::W) {
      tmvec::exp(Vec::load(x + j) - shift).store(mass + j);
    }
    if (full < V) {
      const int rest = static_cast<int>(V - full);
      tmvec::exp(Vec::load_n(x + full, rest) - shift).store_n(mass + full, rest);
    }
    if (cut > 0) {
      for (int64_t j = 0; j < V; ++j) mass[j] = keys[j] < cut ? 0.f : mass[j];
    }
    const uint32_t cut_p = select_key(s, keys, mass, V, top_p, /*of_total=*/true);
    cut = cut_p > cut ? cut_p : cut;
  }
  return key_value(cut);
}

}  // namespace

torch::Tensor top_k_top_p_mask_(torch::Tensor logits, torch::Tensor top_k, torch::Tensor top_p,
                                torch::Tensor min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kFloat,
              "top_k_top_p_mask_: logits must be fp32 [M, V] (V >= 1) with contiguous rows");
  const int64_t M = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(top_k.numel() == 0 || top_k.numel() == M,
              "top_k_top_p_mask_: top_k must hold one value a row, or none");
  TORCH_CHECK(top_p.numel() == 0 || top_p.numel() == M,
              "top_k_top_p_mask_: top_p must hold one value a row, or none");
  TORCH_CHECK(min_p.numel() == 0 || min_p.numel() == M,
              "top_k_top_p_mask_: min_p must hold one value a row, or none");
  const auto k = top_k.to(at::kLong).contiguous();
  const auto p = top_p.to(at::kFloat).contiguous();
  const int64_t* kp = k.numel() ? k.data_ptr<int64_t>() : nullptr;
  const float* pp = p.numel() ? p.data_ptr<float>() : nullptr;
  const auto mp = min_p.to(at::kFloat).contiguous();
  const float* mpp = mp.numel() ? mp.data_ptr<float>() : nullptr;
  auto out = torch::empty({M}, logits.options());
  float* thr = out.data_ptr<float>();
  float* x = logits.data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // (a row of a 32k vocabulary is ~25-60 us: one row a task is grain enough)
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    thread_local Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = x + r * ld;
      const float t = row_threshold(scratch, row, V, kp ? kp[r] : 0, pp ? pp[r] : 1.f,
                                    mpp ? mpp[r] : 0.f);
      thr[r] = t;
      // The mask, while the row is in cache: a float compare, so equal values (-0 and
      // +0 among them) go together.
      if (t > kNegInf) {
        for (int64_t j = 0; j < V; ++j) row[j] = row[j] < t ? kNegInf : row[j];
      }
    }
  });
  return out;
}
