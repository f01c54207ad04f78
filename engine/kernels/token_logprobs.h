// Token log probabilities in one native pass per row of logits (engine.sampler.token_logprobs):
// the row's maximum, the sum of exp(x - max) with a vectorised exp, and its k best scores kept
// in a small sorted list that a vector of scores enters only when one beats the k-th best (rare
// once the list fills), where torch takes a log-sum-exp, a gather and a top-k over the row, each
// its own pass and call. Rows are split over torch's threads.
//
// exp is Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial, the power of
// two set in the exponent bits): within 2 ulp of expf over the range a shifted score takes
// (x - max <= 0; below -87.3 it is 0, as float32's expf underflows there). Sums are float32, in
// 8 lanes, as torch's are in its own lanes.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace pdserve_logprobs {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 splat(float v) { return f8{v, v, v, v, v, v, v, v}; }

inline f8 load8(const float* p) {
  f8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// exp of 8 values x <= 0 (0 below -87.3).
inline f8 exp8(f8 x) {
  const f8 low = splat(-87.3365447504f);
  const auto underflow = x < low;
  x = x < low ? low : x;
  const f8 n = __builtin_convertvector(
      __builtin_convertvector(x * splat(1.44269504088896341f) + splat(0.5f), i8), f8);
  // n = floor(x * log2(e) + 0.5): the conversion truncates toward zero, so step down where
  // that rounded a negative value up
  const f8 fixed = n - (n > x * splat(1.44269504088896341f) + splat(0.5f) ? splat(1.f) : splat(0.f));
  const f8 r = x - fixed * splat(0.693359375f) + fixed * splat(2.12194440e-4f);
  f8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.f);
  const i8 bits = (__builtin_convertvector(fixed, i8) + 127) << 23;
  f8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const f8 result = p * scale;
  return underflow ? splat(0.f) : result;
}

inline float hsum8(f8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

inline float hmax8(f8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// The k best of a row, best first (an equal later score does not displace an earlier one).
struct Best {
  int64_t k, size = 0;
  float* values;
  int64_t* ids;

  float threshold() const { return values[k - 1]; }  // once full

  void offer(float value, int64_t id) {
    if (size == k && !(value > values[k - 1])) return;
    int64_t at = size < k ? size++ : k - 1;
    while (at > 0 && value > values[at - 1]) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = value;
    ids[at] = id;
  }
};

// Row of V scores: its log-sum-exp; its k best (values and ids) into best.
inline float row_logsumexp_and_best(const float* x, int64_t V, Best& best) {
  int64_t j = 0;
  f8 peak = splat(-std::numeric_limits<float>::infinity());
  for (; j + 8 <= V; j += 8) {
    const f8 v = load8(x + j);
    peak = v > peak ? v : peak;
    if (best.size < best.k) {  // the list fills first, -inf scores included
      for (int i = 0; i < 8; ++i) best.offer(v[i], j + i);
    } else if (best.k > 0) {
      const auto above = v > splat(best.threshold());
      uint64_t lanes[4];
      __builtin_memcpy(lanes, &above, sizeof(lanes));
      if (lanes[0] | lanes[1] | lanes[2] | lanes[3])
        for (int i = 0; i < 8; ++i) best.offer(v[i], j + i);
    }
  }
  float top = hmax8(peak);
  for (int64_t t = j; t < V; ++t) {
    top = std::max(top, x[t]);
    if (best.k > 0) best.offer(x[t], t);
  }
  if (std::isinf(top) && top < 0) return top;  // every score -inf: nothing is possible
  f8 sums = splat(0.f);
  const f8 shift = splat(top);
  for (j = 0; j + 8 <= V; j += 8) sums += exp8(load8(x + j) - shift);
  float sum = hsum8(sums);
  for (int64_t t = j; t < V; ++t) sum += std::exp(x[t] - top);
  return top + std::log(sum);
}

// scores [R, V] float32 (contiguous), chosen [R] int64, k >= 0: (the chosen tokens' log
// probabilities [R], the k best log probabilities [R, k], their ids [R, k]).
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> token_logprobs(
    torch::Tensor scores, torch::Tensor chosen, int64_t k) {
  TORCH_CHECK(scores.scalar_type() == torch::kFloat32 && scores.dim() == 2 &&
                  scores.is_contiguous() && !scores.is_cuda(),
              "token_logprobs: contiguous float32 CPU scores [rows, vocab]");
  const int64_t R = scores.size(0), V = scores.size(1);
  TORCH_CHECK(chosen.scalar_type() == torch::kInt64 && chosen.numel() == R,
              "token_logprobs: one int64 chosen token a row");
  TORCH_CHECK(k >= 0 && k <= V, "token_logprobs: k in [0, vocab]");
  auto picked = torch::empty({R}, scores.options());
  auto values = torch::empty({R, k}, scores.options());
  auto ids = torch::empty({R, k}, chosen.options());
  const float* x = scores.data_ptr<float>();
  const int64_t* c = chosen.data_ptr<int64_t>();
  float* p = picked.data_ptr<float>();
  float* vals = values.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * V;
      Best best{k, 0, vals + r * k, id + r * k};
      const float total = row_logsumexp_and_best(row, V, best);
      TORCH_CHECK(c[r] >= 0 && c[r] < V, "token_logprobs: chosen token ", c[r], " not in [0, ",
                  V, ")");
      p[r] = row[c[r]] - total;
      for (int64_t i = 0; i < k; ++i) best.values[i] -= total;
    }
  });
  return {picked, values, ids};
}

}  // namespace pdserve_logprobs
