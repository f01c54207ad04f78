// The AVX2 + FMA + F16C path for Q4_1 blocks: each block becomes floats in registers, with no
// stop in memory (the other kinds, and AVX-512, run quantized_simd.h, which is as fast for Q8_0
// and 1.2-1.5x slower for Q4_1 here: python -m benchmarks.engine.avx2_paths).
//
// Each block is turned into its float weights once, in registers, bit for bit as ggml
// dequantizes them (d * q is exact in float32, so fma(d, q, m) == d * q + m), and multiplied
// against a tile of up to 4 rows of x, each row summed exactly as it would be alone
// (rows_dot_avx2).
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

// R rows of x against one weight row of `blocks` blocks: each block becomes floats once and
// meets all R rows. Each row's sum is taken in one order whatever R is (batch invariance): a
// block's 4 vectors alternate between two accumulators, and the sum is hsum(first + second),
// stored in out.
template <Kind K, int R>
PDSERVE_AVX2 void rows_dot_avx2(const uint8_t* row, int64_t blocks, const float* x, int64_t ldx,
                                float* out, int64_t ldo) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t b = 0; b < blocks; ++b) {
    block_weights<K>(row + b * block_bytes(K), w);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * 32;
      for (int i = 0; i < 4; ++i) {
        __m256& chain = acc[r][i % 2];
        chain = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), chain);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// Rows of x an AVX2 tile takes: 2 accumulators a row stay in the 16 registers.
constexpr int64_t kAvx2TileRows = 4;

template <Kind K>
PDSERVE_AVX2 void rows_dot_avx2_any(int rows, const uint8_t* row, int64_t blocks, const float* x,
                                    int64_t ldx, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return rows_dot_avx2<K, 1>(row, blocks, x, ldx, out, ldo);
    case 2: return rows_dot_avx2<K, 2>(row, blocks, x, ldx, out, ldo);
    case 3: return rows_dot_avx2<K, 3>(row, blocks, x, ldx, out, ldo);
    case 4: return rows_dot_avx2<K, 4>(row, blocks, x, ldx, out, ldo);
    default: TORCH_CHECK(false, "row tile of ", rows, " rows");
  }
}

// Outputs [begin, end) for all M rows of x, a chunk of weight rows at a time (each weight row
// meets every tile of x rows while it is in L1). Thread bodies are functions of their own: a
// lambda would not carry the target attribute.
template <Kind K>
PDSERVE_AVX2 void linear_rows_avx2(int64_t begin, int64_t end, const uint8_t* weight, int64_t N,
                                   int64_t blocks, const float* x, int64_t M, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K), K32 = blocks * 32;
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

template <Kind K>
void linear_avx2(const uint8_t* weight, int64_t N, int64_t blocks, const float* x, int64_t M,
                 float* out, int64_t grain) {
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    linear_rows_avx2<K>(begin, end, weight, N, blocks, x, M, out);
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
