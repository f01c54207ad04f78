// The small float32 operations between a decoder layer's projections, in the operation order of
// the Python path (llama.py).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// exp(x) to about one float32 ulp in straight-line code the compiler vectorizes (std::exp is a
// call per value): x = n ln 2 + r with |r| <= ln 2 / 2, exp(r) by Cephes' expf polynomial, 2^n
// put into the exponent bits. x is clamped to where 2^n is a normal float.
inline float exp_vectorizable(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365478515625f, x));
  constexpr float round_magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return e * two_n;
}

// act[j] = silu(gate[j]) * up[j], silu(g) = g / (1 + exp(-g)) as torch writes it (its exp is
// vectorized too, to a similar ulp).
inline void silu_mul(const float* gate, const float* up, int64_t n, float* act) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    act[j] = gate[j] / (1.f + exp_vectorizable(-gate[j])) * up[j];
}

// Thread t's share [begin, end) of n items split evenly over T threads.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int T) {
  return {n * t / T, n * (t + 1) / T};
}

}  // namespace pdserve_decode
