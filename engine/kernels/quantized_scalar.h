// The portable path: each block dequantized into floats, bit for bit as ggml does it, then dot
// products of 32 weights against every row of x.
#pragma once

#include "quantized_half.h"
#include "quantized_kquants.h"
#include "quantized_legacy.h"

namespace pdserve_quantized {

template <Kind K>
inline void unpack(const uint8_t* block, Unpacked<K>& u) {
  if constexpr (block_weights(K) == 256)
    unpack_kquant<K>(block, u);
  else
    unpack_legacy<K>(block, u);
}

// The weights of one block, exactly as ggml's dequantization gives them.
template <Kind K>
inline void dequantize_block_scalar(const uint8_t* block, float* w) {
  if constexpr (is_half(K)) {
    for (int j = 0; j < 32; ++j) w[j] = half_weight<K>(block + 2 * j);
  } else {
    Unpacked<K> u;
    unpack<K>(block, u);
    for (int64_t i = 0; i < block_weights(K); ++i) {
      const int64_t s = i / sub_weights(K);
      const float q = static_cast<float>(u.q[i]);
      w[i] = has_offset(K) ? u.scale[s] * q + u.offset[s] : u.scale[s] * q;
    }
  }
}

inline float dot32_scalar(const float* x, const float* w) {
  float sum = 0.f;
  for (int j = 0; j < 32; ++j) sum += x[j] * w[j];
  return sum;
}

// out[m * ldo] = dot(x[m], weight row) for all M rows of x.
template <Kind K>
void row_scalar(const uint8_t* row, int64_t blocks, const float* x, int64_t M, int64_t ldx,
                float* out, int64_t ldo, float* sums) {
  constexpr int64_t W = block_weights(K);
  float w[W];
  std::fill(sums, sums + M, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    dequantize_block_scalar<K>(row + b * block_bytes(K), w);
    for (int64_t c = 0; c < W; c += 32)
      for (int64_t m = 0; m < M; ++m) sums[m] += dot32_scalar(x + m * ldx + b * W + c, w + c);
  }
  for (int64_t m = 0; m < M; ++m) out[m * ldo] = sums[m];
}

// Outputs [begin, end) for all M rows of x; out row m starts at out + m * ldo.
template <Kind K>
void linear_rows_scalar(int64_t begin, int64_t end, const uint8_t* weight, int64_t ldo,
                        int64_t blocks, const float* x, int64_t M, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K), row_weights = blocks * block_weights(K);
  std::vector<float> sums(M);
  for (int64_t n = begin; n < end; ++n)
    row_scalar<K>(weight + n * row_bytes, blocks, x, M, row_weights, out + n, ldo, sums.data());
}

template <Kind K>
void linear_scalar(const uint8_t* weight, int64_t N, int64_t blocks, const float* x, int64_t M,
                   float* out, int64_t grain) {
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    linear_rows_scalar<K>(begin, end, weight, N, blocks, x, M, out);
  });
}

template <Kind K>
void dequantize_scalar(const uint8_t* weight, int64_t N, int64_t blocks, float* out) {
  const int64_t row_bytes = blocks * block_bytes(K);
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dequantize_block_scalar<K>(weight + (i / blocks) * row_bytes + (i % blocks) * block_bytes(K),
                                 out + i * block_weights(K));
  });
}

}  // namespace pdserve_quantized
