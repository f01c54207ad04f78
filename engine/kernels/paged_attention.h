// Decode attention over a paged KV cache, read in place (no gathered copy of the context).
//
// One query token per sequence. Work is split over (sequence, kv head), so one sequence spreads
// over the threads too; the query heads that share a kv head are handled together, so each key
// and value row is read once. The cache holds float32, float16 or bfloat16 (the element type
// `T` of the templates below); 16-bit rows are widened to float32 as they are read, and every
// sum is taken in float32.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

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

// 8 float16 values widened to float32 (exact).
inline vec8 load8(const c10::Half* p) {
#if defined(__F16C__)
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  vec8 v;
  __builtin_memcpy(&v, &wide, sizeof(v));
  return v;
#else
  vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// 8 bfloat16 values widened to float32 (exact: the 16 bits are a float32's upper half).
inline vec8 load8(const c10::BFloat16* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 half;
  __builtin_memcpy(&half, p, sizeof(half));
  const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
  vec8 v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

// A cache row of D values written from float32 (float16 and bfloat16 round to nearest even,
// as torch's conversions do).
template <typename T>
inline void store_row(const float* x, T* row, int64_t D) {
  for (int64_t d = 0; d < D; ++d) row[d] = static_cast<T>(x[d]);
}

template <>
inline void store_row(const float* x, c10::Half* row, int64_t D) {
  int64_t d = 0;
#if defined(__F16C__)
  for (; d + 8 <= D; d += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + d), half);
  }
#endif
  for (; d < D; ++d) row[d] = static_cast<c10::Half>(x[d]);
}

template <>
inline void store_row(const float* x, c10::BFloat16* row, int64_t D) {
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    u32x8 bits;
    __builtin_memcpy(&bits, x + d, sizeof(bits));
    const vec8 v = load8(x + d);
    const auto nan = v != v;  // all bits set in a lane holding a NaN
    uint64_t lanes[4];
    __builtin_memcpy(lanes, &nan, sizeof(lanes));
    if (lanes[0] | lanes[1] | lanes[2] | lanes[3]) break;  // the scalar tail keeps torch's NaN
    // round to nearest even on the upper 16 bits, as c10::BFloat16 does for every finite value
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    const u16x8 upper = __builtin_convertvector(bits >> 16, u16x8);
    __builtin_memcpy(row + d, &upper, sizeof(upper));
  }
  for (; d < D; ++d) row[d] = static_cast<c10::BFloat16>(x[d]);
}

inline float hsum(vec8 a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// scores[g] = dot(q + g * D, k) for the G query heads of one kv head; k is read once and the
// G accumulators stay in registers (G is a compile-time constant).
template <int G, typename T>
inline void group_dots_fixed(const float* q, const T* k, int64_t D, float* scores) {
  vec8 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = vec8{};
  for (int64_t d = 0; d < D; d += 8) {
    const vec8 kv = load8(k + d);
    for (int g = 0; g < G; ++g) acc[g] += load8(q + g * D + d) * kv;
  }
  for (int g = 0; g < G; ++g) scores[g] = hsum(acc[g]);
}

template <typename T>
inline void group_dots(const float* q, const T* k, int64_t G, int64_t D, float* scores) {
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
    for (int64_t d = 0; d < D; ++d) sum += q[g * D + d] * static_cast<float>(k[d]);
    scores[g] = sum;
  }
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vec8 out = load8(y + i) + alpha * load8(x + i);
    __builtin_memcpy(y + i, &out, sizeof(out));
  }
  for (; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

// Calls fn(t, slot) for the first L tokens of a block table, without a division per token.
template <typename Fn>
inline void for_each_token(const int64_t* table, int64_t L, int64_t BS, Fn&& fn) {
  for (int64_t t = 0, block = 0; t < L; ++block) {
    const int64_t base = table[block] * BS, end = std::min(L, t + BS);
    for (int64_t slot = base; t < end; ++t, ++slot) fn(t, slot);
  }
}

// Attention of the G query heads of kv head h of one sequence (L cached tokens): qg, og point at
// those heads' [G, D] query and output rows; scores, top, total are scratch for L * G, G, G.
template <typename T>
inline void group_attention(const float* qg, int64_t G, int64_t D, const T* kp,
                            const T* vp, int64_t KVH, int64_t h, const int64_t* table,
                            int64_t L, int64_t BS, float fscale, float* og,
                            std::vector<float>& scores, std::vector<float>& top,
                            std::vector<float>& total) {
  scores.resize(L * G);  // [t][g]
  std::fill(top.begin(), top.begin() + G, -INFINITY);
  std::fill(total.begin(), total.begin() + G, 0.f);
  for_each_token(table, L, BS, [&](int64_t t, int64_t slot) {
    float* s = scores.data() + t * G;
    group_dots(qg, kp + (slot * KVH + h) * D, G, D, s);
    for (int64_t g = 0; g < G; ++g) top[g] = std::max(top[g], s[g] *= fscale);
  });
  for (int64_t t = 0; t < L; ++t)
    for (int64_t g = 0; g < G; ++g)
      total[g] += (scores[t * G + g] = std::exp(scores[t * G + g] - top[g]));
  std::fill(og, og + G * D, 0.f);
  for_each_token(table, L, BS, [&](int64_t t, int64_t slot) {
    const float* s = scores.data() + t * G;
    const T* v = vp + (slot * KVH + h) * D;
    for (int64_t g = 0; g < G; ++g) axpy(s[g], v, og + g * D, D);
  });
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / total[g];
    for (int64_t d = 0; d < D; ++d) og[g * D + d] *= inv;
  }
}

// Decode attention on raw pointers. q, out: [B, H, D]; kp, vp: the key and value halves of one
// layer's cache, [num_blocks, BS, KVH, D] each, of float, c10::Half or c10::BFloat16; tables: [B, max_blocks]; lens: [B].
// One work item per (sequence, kv head), so a single sequence still spreads over every thread
// (its kv heads), and the query heads of a kv head read each key and value row once.
template <typename T>
inline void paged_decode(const float* qp, int64_t B, int64_t H, int64_t D, const T* kp,
                         const T* vp, int64_t BS, int64_t KVH, const int64_t* tables,
                         int64_t max_blocks, const int64_t* lens, float fscale, float* op) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, top(G), total(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t offset = (b * H + h * G) * D;
      group_attention(qp + offset, G, D, kp, vp, KVH, h, tables + b * max_blocks, lens[b], BS,
                      fscale, op + offset, scores, top, total);
    }
  });
}

// fn(T{}) for the cache element type T of `type` (float32, float16, bfloat16).
template <typename Fn>
inline void with_cache_type(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kFloat: return fn(float{});
    case at::kHalf: return fn(c10::Half{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    default: TORCH_CHECK(false, "KV cache: float32, float16 or bfloat16, got ", type);
  }
}

}  // namespace pdserve_attention
