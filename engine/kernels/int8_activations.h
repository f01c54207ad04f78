// Quantized linear layers with 8-bit activations (opt-in): each row of x is quantized per block of
// 32 (d = max|x_b| / 127, q = round(x_b / d)), and a block's products are summed in integers,
// 32 at a time (AVX2 maddubs), as llama.cpp's Q8_0 / Q8_1 dot products do. The result equals
// dequantize(quantize(x)) @ dequantize(w).T up to float32 summation order:
//
//   Q8_0 weights:  sum_b d_w * d_x * sum_j(w_j * q_j)
//   Q4_1 weights:  sum_b d_w * d_x * sum_j(w_j * q_j) + m_w * d_x * sum_j(q_j)
//
// Integer sums cannot overflow: a pair of products is at most 2 * 128 * 127 < 2^15 in maddubs.
#pragma once

#include "quantized_linear.h"

#include <cmath>

namespace pdserve_quantized {

// x [M, 32 * blocks] quantized per block: q [M * blocks * 32], d and d * sum(q) per block.
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, d_sum;
};

inline Int8Rows quantize_rows(const float* x, int64_t M, int64_t blocks) {
  Int8Rows rows{std::vector<int8_t>(M * blocks * 32), std::vector<float>(M * blocks),
                std::vector<float>(M * blocks)};
  for (int64_t i = 0; i < M * blocks; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * inverse));
      rows.q[i * 32 + j] = static_cast<int8_t>(q);
      sum += q;
    }
    rows.d[i] = d;
    rows.d_sum[i] = d * static_cast<float>(sum);
  }
  return rows;
}

template <Kind K>
float row_dot_int8_scalar(const uint8_t* row, int64_t blocks, const int8_t* q, const float* d,
                          const float* d_sum) {
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes(K);
    const int8_t* qb = q + b * 32;
    int32_t products = 0;
    if constexpr (K == Kind::q8_0) {
      const auto* w = reinterpret_cast<const int8_t*>(block + 2);
      for (int j = 0; j < 32; ++j) products += w[j] * qb[j];
      total += half_to_float(block) * d[b] * static_cast<float>(products);
    } else {
      const uint8_t* qs = block + 4;
      for (int j = 0; j < 16; ++j) products += (qs[j] & 0x0F) * qb[j] + (qs[j] >> 4) * qb[j + 16];
      total += half_to_float(block) * d[b] * static_cast<float>(products) +
               half_to_float(block + 2) * d_sum[b];
    }
  }
  return total;
}

template <Kind K>
void rows_int8_scalar(int64_t begin, int64_t end, const uint8_t* weight, int64_t N,
                      int64_t blocks, const Int8Rows& x, int64_t M, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K);
  for (int64_t n = begin; n < end; ++n)
    for (int64_t m = 0; m < M; ++m)
      out[m * N + n] = row_dot_int8_scalar<K>(weight + n * row_bytes, blocks,
                                              x.q.data() + m * blocks * 32, x.d.data() + m * blocks,
                                              x.d_sum.data() + m * blocks);
}

#if PDSERVE_HAS_X86

// The 32 integer products of one block summed into 8 int32 lanes, as floats.
template <Kind K>
PDSERVE_AVX2 inline __m256 block_products_avx2(const uint8_t* block, const int8_t* q) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  __m256i pairs;
  if constexpr (K == Kind::q8_0) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    // maddubs takes unsigned x signed bytes: |w| against x carrying w's sign
    pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low),
                                       _mm_and_si128(qs, low));  // weights 0..15, then 16..31
    pairs = _mm256_maddubs_epi16(w, x);
  }
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Even and odd blocks in separate accumulators, so consecutive blocks do not wait on each other.
template <Kind K>
PDSERVE_AVX2 float row_dot_int8_avx2(const uint8_t* row, int64_t blocks, const int8_t* q,
                                     const float* d, const float* d_sum) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  float min_terms = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes(K);
    const __m256 scale = _mm256_set1_ps(half_to_float_f16c(block) * d[b]);
    acc[b & 1] = _mm256_fmadd_ps(scale, block_products_avx2<K>(block, q + b * 32), acc[b & 1]);
    if constexpr (K == Kind::q4_1) min_terms += half_to_float_f16c(block + 2) * d_sum[b];
  }
  return hsum(_mm256_add_ps(acc[0], acc[1])) + min_terms;
}

template <Kind K>
PDSERVE_AVX2 void rows_int8_avx2(int64_t begin, int64_t end, const uint8_t* weight, int64_t N,
                                 int64_t blocks, const Int8Rows& x, int64_t M, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K);
  for (int64_t n = begin; n < end; ++n)
    for (int64_t m = 0; m < M; ++m)
      out[m * N + n] = row_dot_int8_avx2<K>(weight + n * row_bytes, blocks,
                                            x.q.data() + m * blocks * 32, x.d.data() + m * blocks,
                                            x.d_sum.data() + m * blocks);
}

#endif  // PDSERVE_HAS_X86

template <Kind K>
void linear_int8(const uint8_t* weight, int64_t N, int64_t blocks, const float* x, int64_t M,
                 float* out) {
  const Int8Rows rows = quantize_rows(x, M, blocks);
  const int64_t work_per_row = std::max<int64_t>(1, blocks * 32 * M);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / work_per_row);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
#if PDSERVE_HAS_X86
    if (use_avx2()) return rows_int8_avx2<K>(begin, end, weight, N, blocks, rows, M, out);
#endif
    rows_int8_scalar<K>(begin, end, weight, N, blocks, rows, M, out);
  });
}

// out [M, N] = quantize8(x) [M, 32 * blocks] . w^T for weight blocks w [N, blocks * block bytes].
inline void quantized_matmul_int8(const float* x, int64_t M, const uint8_t* w, Kind kind,
                                  int64_t N, int64_t blocks, float* out) {
  if (kind == Kind::q8_0)
    linear_int8<Kind::q8_0>(w, N, blocks, x, M, out);
  else
    linear_int8<Kind::q4_1>(w, N, blocks, x, M, out);
}

}  // namespace pdserve_quantized
