// The small float32 operations between a decoder layer's projections, in the operation order of
// the Python path (llama.py).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace pdserve_decode {

// out[m] = x[m] / rms(x[m]) * weight, as torch's rms_norm computes it in float32.
inline void rms_norm(const float* x, const float* weight, int64_t M, int64_t E, float eps,
                     float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * E;
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += row[e] * row[e];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e) out[m * E + e] = row[e] * inv * weight[e];
  }
}

// Rotate-half RoPE on `heads` heads of D values starting at v, with this token's cos, sin rows.
inline void rotate(float* v, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h, v += D)
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = v[d], x2 = v[d + half];
      v[d] = x1 * cos[d] - x2 * sin[d];
      v[d + half] = x2 * cos[d + half] + x1 * sin[d + half];
    }
}

inline void add_into(float* h, const float* delta, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] += delta[i];
}

// act[j] = silu(gate[j]) * up[j], silu(g) = g / (1 + exp(-g)) as torch writes it.
inline void silu_mul(const float* gate, const float* up, int64_t n, float* act) {
  for (int64_t j = 0; j < n; ++j) act[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

// Thread t's share [begin, end) of n items split evenly over T threads.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int T) {
  return {n * t / T, n * (t + 1) / T};
}

}  // namespace pdserve_decode
