// Decode attention over a paged KV cache, read in place (no gathered copy of the context).
//
// One query token per sequence. Work is split over (sequence, kv head); the query heads that
// share a kv head are handled together, so each key and value row is read once.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace pdserve_attention {

typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(vec8 a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// scores[g] = dot(q + g * D, k) for the G query heads of one kv head; k is read once and the
// G accumulators stay in registers (G is a compile-time constant).
template <int G>
inline void group_dots_fixed(const float* q, const float* k, int64_t D, float* scores) {
  vec8 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = vec8{};
  for (int64_t d = 0; d < D; d += 8) {
    const vec8 kv = load8(k + d);
    for (int g = 0; g < G; ++g) acc[g] += load8(q + g * D + d) * kv;
  }
  for (int g = 0; g < G; ++g) scores[g] = hsum(acc[g]);
}

inline void group_dots(const float* q, const float* k, int64_t G, int64_t D, float* scores) {
  if (D % 8 == 0) {
    switch (G) {
      case 1: return group_dots_fixed<1>(q, k, D, scores);
      case 2: return group_dots_fixed<2>(q, k, D, scores);
      case 3: return group_dots_fixed<3>(q, k, D, scores);
      case 4: return group_dots_fixed<4>(q, k, D, scores);
      case 5: return group_dots_fixed<5>(q, k, D, scores);
      case 6: return group_dots_fixed<6>(q, k, D, scores);
      case 7: return group_dots_fixed<7>(q, k, D, scores);
      case 8: return group_dots_fixed<8>(q, k, D, scores);
      default: break;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) sum += q[g * D + d] * k[d];
    scores[g] = sum;
  }
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Calls fn(t, slot) for the first L tokens of a block table, without a division per token.
template <typename Fn>
inline void for_each_token(const int64_t* table, int64_t L, int64_t BS, Fn&& fn) {
  for (int64_t t = 0, block = 0; t < L; ++block) {
    const int64_t base = table[block] * BS, end = std::min(L, t + BS);
    for (int64_t slot = base; t < end; ++t, ++slot) fn(t, slot);
  }
}

// Decode attention on raw pointers. q, out: [B, H, D]; kp, vp: the key and value halves of one
// layer's cache, [num_blocks, BS, KVH, D] each; tables: [B, max_blocks]; lens: [B].
inline void paged_decode(const float* qp, int64_t B, int64_t H, int64_t D, const float* kp,
                         const float* vp, int64_t BS, int64_t KVH, const int64_t* tables,
                         int64_t max_blocks, const int64_t* lens, float fscale, float* op) {
  const int64_t G = H / KVH;
  // One sequence per work item: each cached row holds every kv head, so a row is read whole.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> top(H), total(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      scores.resize(L * H);  // [t][head]
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(total.begin(), total.end(), 0.f);
      for_each_token(table, L, BS, [&](int64_t t, int64_t slot) {
        float* s = scores.data() + t * H;
        for (int64_t h = 0; h < KVH; ++h)
          group_dots(qb + h * G * D, kp + (slot * KVH + h) * D, G, D, s + h * G);
        for (int64_t i = 0; i < H; ++i) top[i] = std::max(top[i], s[i] *= fscale);
      });
      for (int64_t t = 0; t < L; ++t)
        for (int64_t i = 0; i < H; ++i)
          total[i] += (scores[t * H + i] = std::exp(scores[t * H + i] - top[i]));
      std::fill(ob, ob + H * D, 0.f);
      for_each_token(table, L, BS, [&](int64_t t, int64_t slot) {
        const float* s = scores.data() + t * H;
        for (int64_t h = 0; h < KVH; ++h) {
          const float* v = vp + (slot * KVH + h) * D;
          for (int64_t g = 0; g < G; ++g) axpy(s[h * G + g], v, ob + (h * G + g) * D, D);
        }
      });
      for (int64_t i = 0; i < H; ++i) {
        const float inv = 1.f / total[i];
        for (int64_t d = 0; d < D; ++d) ob[i * D + d] *= inv;
      }
    }
  });
}

}  // namespace pdserve_attention
