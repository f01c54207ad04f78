// The AVX2 + FMA + F16C path for Q4_1 blocks: each block becomes floats in registers, with no
// stop in memory (the other kinds, and AVX-512, run quantized_simd.h, which is as fast for Q8_0
// and 1.2-1.5x slower for Q4_1 here: python -m benchmarks.engine.avx2_paths).
//
// Each block is turned into its float weights once, in registers, bit for bit as ggml
// dequantizes them (d * q is exact in float32, so fma(d, q, m) == d * q + m), and multiplied
// against a tile of up to 8 rows of x, each row summed exactly as it would be alone
// (rows_dot_avx2). A lone row that need not be batch invariant takes row_dot_avx2: per block
// d * dot(x_b, q) + m * sum(x_b), fewer operations in another order.
#pragma once

#include "quantized_kinds.h"

namespace pdserve_quantized {

#if PDSERVE_HAS_X86

PDSERVE_AVX2 inline float half_to_float_f16c(const uint8_t* p) { return _cvtsh_ss(read_u16(p)); }

PDSERVE_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The integer values q of a block, in weight order, as floats (not yet scaled).
template <Kind K>
PDSERVE_AVX2 inline void block_values(const uint8_t* block, __m256 q[4]) {
  // Each of bytes 0..7 widened to 32 bits holds weight j in its low nibble and weight j + 16 in
  // its high nibble; likewise bytes 8..15 for weights 8..15 and 24..31.
  const __m256i low_nibble = _mm256_set1_epi32(0x0F);
  for (int half = 0; half < 2; ++half) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4 + 8 * half));
    const __m256i bytes = _mm256_cvtepu8_epi32(eight);
    q[half] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_nibble));
    q[half + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
}

// The 32 weights of a block as floats, bit for bit what ggml's dequantization gives
// (d * q is exact, so fma(d, q, m) rounds once, as d * q + m does).
template <Kind K>
PDSERVE_AVX2 inline void block_weights(const uint8_t* block, __m256 w[4]) {
  block_values<K>(block, w);
  const __m256 d = _mm256_set1_ps(half_to_float_f16c(block));
  const __m256 m = _mm256_set1_ps(half_to_float_f16c(block + 2));
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);
}

// dot(x, q) over one block, in two independent chains.
PDSERVE_AVX2 inline __m256 block_dot(const __m256 q[4], const float* x) {
  const __m256 even = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16),
                                      _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
  const __m256 odd = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24),
                                     _mm256_mul_ps(q[1], _mm256_loadu_ps(x + 8)));
  return _mm256_add_ps(even, odd);
}

// acc += d * dot(x_b, q) for one block and min_terms[1] += m * sum(x_b), where sum_pair points
// at {0, sum(x_b)}: d and m, adjacent in the block, are converted together.
template <Kind K>
PDSERVE_AVX2 inline void add_block_dot(const uint8_t* block, const float* x,
                                       const float* sum_pair, __m256& acc, __m128& min_terms) {
  __m256 q[4];
  block_values<K>(block, q);
  uint32_t scale_and_min;
  std::memcpy(&scale_and_min, block, sizeof(scale_and_min));
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(scale_and_min)));
  acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), block_dot(q, x), acc);
  const __m128 sums = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sum_pair)));
  min_terms = _mm_fmadd_ps(dm, sums, min_terms);
}

// One row of x against one weight row over blocks [b0, b1): the sum of d * dot(x_b, q) +
// m * sum(x_b), with the block sums of x, as {0, sum} pairs, computed once per call: the lone row of a
// step that need not be batch invariant (fewer operations than rows_dot_avx2, another order).
// Even and odd blocks go to separate accumulators, so consecutive blocks do not wait on each
// other.
template <Kind K>
PDSERVE_AVX2 float row_dot_avx2(const uint8_t* row, int64_t b0, int64_t b1, const float* x,
                                const float* x_sum_pairs) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  __m128 even_min_terms = _mm_setzero_ps(), odd_min_terms = _mm_setzero_ps();
  const auto sum_pair = [x_sum_pairs](int64_t b) { return x_sum_pairs + 2 * b; };
  int64_t b = b0;
  for (; b + 1 < b1; b += 2) {
    add_block_dot<K>(row + b * block_bytes(K), x + b * 32, sum_pair(b), even, even_min_terms);
    add_block_dot<K>(row + (b + 1) * block_bytes(K), x + (b + 1) * 32, sum_pair(b + 1), odd,
                     odd_min_terms);
  }
  if (b < b1)
    add_block_dot<K>(row + b * block_bytes(K), x + b * 32, sum_pair(b), even, even_min_terms);
  const __m128 min_terms = _mm_add_ps(even_min_terms, odd_min_terms);
  return hsum(_mm256_add_ps(even, odd)) + _mm_cvtss_f32(_mm_movehdup_ps(min_terms));
}

// R rows of x against one weight row of `blocks` blocks: each block becomes floats once and
// meets all R rows. Each row's sum is taken in one order whatever R is (batch invariance): one
// accumulator a row (the rows are the independent chains), hsum'd into out.
template <Kind K, int R>
PDSERVE_AVX2 void rows_dot_avx2(const uint8_t* row, int64_t blocks, const float* x, int64_t ldx,
                                float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t b = 0; b < blocks; ++b) {
    block_weights<K>(row + b * block_bytes(K), w);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * 32;
      for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]);
}

// Rows of x an AVX2 tile takes: 8 accumulators in the 16 registers, one a row.
constexpr int64_t kAvx2TileRows = 8;

template <Kind K>
PDSERVE_AVX2 void rows_dot_avx2_any(int rows, const uint8_t* row, int64_t blocks, const float* x,
                                    int64_t ldx, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return rows_dot_avx2<K, 1>(row, blocks, x, ldx, out, ldo);
    case 2: return rows_dot_avx2<K, 2>(row, blocks, x, ldx, out, ldo);
    case 3: return rows_dot_avx2<K, 3>(row, blocks, x, ldx, out, ldo);
    case 4: return rows_dot_avx2<K, 4>(row, blocks, x, ldx, out, ldo);
    case 5: return rows_dot_avx2<K, 5>(row, blocks, x, ldx, out, ldo);
    case 6: return rows_dot_avx2<K, 6>(row, blocks, x, ldx, out, ldo);
    case 7: return rows_dot_avx2<K, 7>(row, blocks, x, ldx, out, ldo);
    case 8: return rows_dot_avx2<K, 8>(row, blocks, x, ldx, out, ldo);
    default: TORCH_CHECK(false, "row tile of ", rows, " rows");
  }
}

// Outputs [begin, end) for all M rows of x, a chunk of weight rows at a time (each weight row
// meets every tile of x rows while it is in L1). Thread bodies are functions of their own: a
// lambda would not carry the target attribute.
template <Kind K>
PDSERVE_AVX2 void linear_rows_avx2(int64_t begin, int64_t end, const uint8_t* weight, int64_t N,
                                   int64_t blocks, const float* x, int64_t M,
                                   const float* x_sum_pairs, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K), K32 = blocks * 32;
  if (M == 1 && !batch_invariant().load(std::memory_order_relaxed)) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = weight + n * row_bytes;
      prefetch_row_ahead<K>(row, n, end, row_bytes, 0, blocks);
      out[n] = row_dot_avx2<K>(row, 0, blocks, x, x_sum_pairs);
    }
    return;
  }
  for (int64_t n0 = begin; n0 < end; n0 += kWeightRowChunk) {
    const int64_t n1 = std::min(end, n0 + kWeightRowChunk);
    for (int64_t m = 0; m < M; m += kAvx2TileRows) {
      const int rows = static_cast<int>(std::min(kAvx2TileRows, M - m));
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = weight + n * row_bytes;
        if (m == 0) prefetch_row_ahead<K>(row, n, end, row_bytes, 0, blocks);
        rows_dot_avx2_any<K>(rows, row, blocks, x + m * K32, K32, out + m * N + n, N);
      }
    }
  }
}

// The block sums of x as {0, sum} pairs that row_dot_avx2 needs (one row, not batch
// invariant); pairs is left empty otherwise.
template <Kind K>
void prepare_x_sum_pairs(const float* x, int64_t M, int64_t blocks, std::vector<float>& pairs) {
  pairs.clear();
  if (M != 1 || batch_invariant().load()) return;
  pairs.assign(2 * blocks, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    float sum = 0.f;
    for (int j = 0; j < 32; ++j) sum += x[b * 32 + j];
    pairs[2 * b + 1] = sum;
  }
}

template <Kind K>
void linear_avx2(const uint8_t* weight, int64_t N, int64_t blocks, const float* x, int64_t M,
                 float* out, int64_t grain) {
  std::vector<float> x_sum_pairs;
  prepare_x_sum_pairs<K>(x, M, blocks, x_sum_pairs);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    linear_rows_avx2<K>(begin, end, weight, N, blocks, x, M, x_sum_pairs.data(), out);
  });
}

template <Kind K>
PDSERVE_AVX2 void dequantize_rows_avx2(int64_t begin, int64_t end, const uint8_t* weight,
                                       int64_t blocks, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K);
  __m256 w[4];
  for (int64_t n = begin; n < end; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      block_weights<K>(weight + n * row_bytes + b * block_bytes(K), w);
      float* o = out + (n * blocks + b) * 32;
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, w[i]);
    }
}

template <Kind K>
void dequantize_avx2(const uint8_t* weight, int64_t N, int64_t blocks, float* out) {
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / blocks), [&](int64_t begin, int64_t end) {
    dequantize_rows_avx2<K>(begin, end, weight, blocks, out);
  });
}

#endif  // PDSERVE_HAS_X86

}  // namespace pdserve_quantized
