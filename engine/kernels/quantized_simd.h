// The SIMD path for every kind, written once over a vector type V (quantized_vectors.h) and a
// target attribute PDSERVE_TARGET, and included once per instruction set by quantized_linear.h
// (into namespaces simd_avx2 and simd_avx512; hence no include guard).
//
//   - one row of x (a decode step): each block is unpacked into int8 values and per-sub-block
//     scales (quantized_kinds.h), then per sub-block scale * dot(x_s, q) + offset * sum(x_s),
//     the sub-block sums of x computed once per call and shared by all outputs; half weights
//     are widened and multiplied as they are;
//   - several rows: each sub-block is turned into its float weights once, in registers, bit for
//     bit as ggml dequantizes them, and multiplied against a tile of up to 8 rows of x.

using F = V::F;

// Weights of a segment of K when several rows of x are long: a tile of x rows then stays in L1
// while a chunk of weight rows passes.
constexpr int64_t kSegmentWeights = 512;
constexpr int64_t kMaxUnsegmentedWeights = 768;

// Kinds whose values are read vector by vector from the block's own bytes, with only the scales
// unpacked: no stop in memory. On 8 lanes (AVX2), one row of a [2048, 2048] Q4_0 matrix on one
// Zen 3 thread takes 0.33 ms so, 0.55 through the int8 copy. (Q4_1 takes
// quantized_avx2_legacy.h there: python -m benchmarks.engine.avx2_paths.)
constexpr bool values_from_block(Kind kind) { return V::L == 8 && kind == Kind::q4_0; }

template <Kind K>
PDSERVE_TARGET inline void unpack_block(const uint8_t* block, Unpacked<K>& u) {
  if constexpr (is_legacy(K))
    unpack_legacy_avx2<K, !values_from_block(K)>(block, u);
  else if constexpr (!is_half(K))
    unpack<K>(block, u);
}

// Vector i of a block's values before scaling: int8 q, or the half weights themselves.
template <Kind K>
PDSERVE_TARGET inline F values(const uint8_t* block, const Unpacked<K>& u, int64_t i) {
  if constexpr (K == Kind::f16)
    return V::from_f16(block + 2 * i * V::L);
  else if constexpr (K == Kind::bf16)
    return V::from_bf16(block + 2 * i * V::L);
  else if constexpr (values_from_block(K))  // 8 lanes: nibble_vector<K> is that wide
    return nibble_vector<K>(block, i);
  else
    return V::from_i8(u.q + i * V::L);
}

// Vector i (in sub-block s) of a block's weights, bit for bit as ggml dequantizes them.
template <Kind K>
PDSERVE_TARGET inline F weights(const uint8_t* block, const Unpacked<K>& u, int64_t s,
                                int64_t i) {
  const F q = values<K>(block, u, i);
  if constexpr (is_half(K))
    return q;
  else if constexpr (has_offset(K))
    return V::fmadd(V::set1(u.scale[s]), q, V::set1(u.offset[s]));
  else
    return V::mul(V::set1(u.scale[s]), q);
}

// acc += scale_s * dot(x_s, q_s) over sub-block s of a block, offsets += offset_s * sum(x_s).
template <Kind K>
PDSERVE_TARGET inline void add_sub_dot(const uint8_t* block, const Unpacked<K>& u, int64_t s,
                                       const float* x_block, const float* x_sums, F& acc,
                                       float& offsets) {
  constexpr int64_t vectors = sub_weights(K) / V::L;
  const float* xs = x_block + s * sub_weights(K);
  F dot = V::mul(values<K>(block, u, s * vectors), V::load(xs));
  for (int64_t i = 1; i < vectors; ++i)
    dot = V::fmadd(values<K>(block, u, s * vectors + i), V::load(xs + i * V::L), dot);
  if constexpr (is_half(K))
    acc = V::add(acc, dot);
  else
    acc = V::fmadd(V::set1(u.scale[s]), dot, acc);
  if constexpr (has_offset(K)) offsets += u.offset[s] * x_sums[s];
}

// One row of x against one weight row over blocks [b0, b1), with x's sub-block sums. Even and
// odd sub-blocks go to separate accumulators, so consecutive ones do not wait on each other.
template <Kind K>
PDSERVE_TARGET float row_dot(const uint8_t* row, int64_t b0, int64_t b1, const float* x,
                             const float* x_sums) {
  constexpr int64_t W = block_weights(K), S = sub_blocks(K), bytes = block_bytes(K);
  F even = V::zero(), odd = V::zero();
  float even_offsets = 0.f, odd_offsets = 0.f;
  Unpacked<K> u, next;
  int64_t b = b0;
  if constexpr (S == 1) {
    for (; b + 1 < b1; b += 2) {
      const uint8_t* block = row + b * bytes;
      unpack_block<K>(block, u);
      unpack_block<K>(block + bytes, next);
      add_sub_dot<K>(block, u, 0, x + b * W, x_sums + b, even, even_offsets);
      add_sub_dot<K>(block + bytes, next, 0, x + (b + 1) * W, x_sums + b + 1, odd, odd_offsets);
    }
  }
  for (; b < b1; ++b) {
    const uint8_t* block = row + b * bytes;
    unpack_block<K>(block, u);
#pragma GCC unroll 16
    for (int64_t s = 0; s < S; ++s)
      add_sub_dot<K>(block, u, s, x + b * W, x_sums + b * S, s % 2 ? odd : even,
                     s % 2 ? odd_offsets : even_offsets);
  }
  return V::hsum(V::add(even, odd)) + (even_offsets + odd_offsets);
}

// R rows of x against one weight row over blocks [b0, b1): each sub-block becomes floats once
// and meets all R rows. Stores the R sums, or adds them to what out holds.
template <Kind K, int R>
PDSERVE_TARGET void tile_dot(const uint8_t* row, int64_t b0, int64_t b1, const float* x,
                             int64_t ldx, float* out, int64_t ldo, bool accumulate) {
  constexpr int64_t W = block_weights(K), S = sub_blocks(K), SW = sub_weights(K);
  constexpr int64_t vectors = SW / V::L;
  constexpr int kChains = R <= 4 ? 2 : 1;  // enough independent FMA chains to hide latency
  F acc[R][kChains];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = V::zero();
  Unpacked<K> u;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = row + b * block_bytes(K);
    unpack_block<K>(block, u);
    for (int64_t s = 0; s < S; ++s) {
      F w[vectors];
      for (int64_t i = 0; i < vectors; ++i) w[i] = weights<K>(block, u, s, s * vectors + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + b * W + s * SW;
        for (int64_t i = 0; i < vectors; ++i) {
          F& chain = acc[r][i % kChains];
          chain = V::fmadd(w[i], V::load(xr + i * V::L), chain);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    F total = acc[r][0];
    if constexpr (kChains == 2) total = V::add(total, acc[r][1]);
    const float sum = V::hsum(total);
    out[r * ldo] = accumulate ? out[r * ldo] + sum : sum;
  }
}

template <Kind K>
PDSERVE_TARGET void tile_dot_any(int rows, const uint8_t* row, int64_t b0, int64_t b1,
                                 const float* x, int64_t ldx, float* out, int64_t ldo,
                                 bool accumulate) {
  switch (rows) {
    case 2: return tile_dot<K, 2>(row, b0, b1, x, ldx, out, ldo, accumulate);
    case 3: return tile_dot<K, 3>(row, b0, b1, x, ldx, out, ldo, accumulate);
    case 4: return tile_dot<K, 4>(row, b0, b1, x, ldx, out, ldo, accumulate);
    case 5: return tile_dot<K, 5>(row, b0, b1, x, ldx, out, ldo, accumulate);
    case 6: return tile_dot<K, 6>(row, b0, b1, x, ldx, out, ldo, accumulate);
    case 7: return tile_dot<K, 7>(row, b0, b1, x, ldx, out, ldo, accumulate);
    case 8: return tile_dot<K, 8>(row, b0, b1, x, ldx, out, ldo, accumulate);
    default: TORCH_CHECK(false, "row tile of ", rows, " rows");
  }
}

// Outputs [begin, end) for all M rows of x, a chunk of weight rows and a segment of K at a time.
template <Kind K>
PDSERVE_TARGET void linear_rows(int64_t begin, int64_t end, const uint8_t* weight, int64_t N,
                                int64_t blocks, const float* x, int64_t M, const float* x_sums,
                                float* out) {
  constexpr int64_t W = block_weights(K);
  const int64_t row_bytes = blocks * block_bytes(K), row_weights = blocks * W;
  const int64_t segment = M == 1 || row_weights <= kMaxUnsegmentedWeights
                              ? blocks
                              : std::max<int64_t>(1, kSegmentWeights / W);
  for (int64_t n0 = begin; n0 < end; n0 += kWeightRowChunk) {
    const int64_t n1 = std::min(end, n0 + kWeightRowChunk);
    for (int64_t b0 = 0; b0 < blocks; b0 += segment) {
      const int64_t b1 = std::min(blocks, b0 + segment);
      const bool accumulate = b0 > 0;
      for (int64_t m = 0; m < M; m += kRowTile) {
        const int rows = static_cast<int>(std::min(kRowTile, M - m));
        for (int64_t n = n0; n < n1; ++n) {
          const uint8_t* row = weight + n * row_bytes;
          if (m == 0) prefetch_row_ahead<K>(row, n, end, row_bytes, b0, b1);  // this pass's segment
          float* o = out + m * N + n;
          if (rows == 1) {
            const float sum = row_dot<K>(row, b0, b1, x + m * row_weights, x_sums);
            *o = accumulate ? *o + sum : sum;
          } else {
            tile_dot_any<K>(rows, row, b0, b1, x + m * row_weights, row_weights, o, N, accumulate);
          }
        }
      }
    }
  }
}

// A tile of a single row (M = 1, or the last of M = 8t + 1) takes the single-row path, which
// for kinds with offsets needs that row's sub-block sums; x_sums is left empty otherwise.
template <Kind K>
void prepare_x_sums(const float* x, int64_t M, int64_t blocks, std::vector<float>& x_sums) {
  x_sums.clear();
  if (!has_offset(K) || M % kRowTile != 1) return;
  const int64_t subs = blocks * sub_blocks(K), SW = sub_weights(K);
  const float* last = x + (M - 1) * blocks * block_weights(K);
  x_sums.assign(subs, 0.f);
  for (int64_t s = 0; s < subs; ++s) {
    float sum = 0.f;
    for (int64_t j = 0; j < SW; ++j) sum += last[s * SW + j];
    x_sums[s] = sum;
  }
}

template <Kind K>
void linear(const uint8_t* weight, int64_t N, int64_t blocks, const float* x, int64_t M,
            float* out, int64_t grain) {
  std::vector<float> x_sums;
  prepare_x_sums<K>(x, M, blocks, x_sums);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    linear_rows<K>(begin, end, weight, N, blocks, x, M, x_sums.data(), out);
  });
}

template <Kind K>
PDSERVE_TARGET void dequantize_rows(int64_t begin, int64_t end, const uint8_t* weight,
                                    int64_t blocks, float* out) {
  constexpr int64_t W = block_weights(K), S = sub_blocks(K), vectors = sub_weights(K) / V::L;
  const int64_t row_bytes = blocks * block_bytes(K);
  Unpacked<K> u;
  for (int64_t n = begin; n < end; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = weight + n * row_bytes + b * block_bytes(K);
      unpack_block<K>(block, u);
      float* o = out + (n * blocks + b) * W;
      for (int64_t s = 0; s < S; ++s)
        for (int64_t i = 0; i < vectors; ++i)
          V::store(o + (s * vectors + i) * V::L, weights<K>(block, u, s, s * vectors + i));
    }
}

template <Kind K>
void dequantize(const uint8_t* weight, int64_t N, int64_t blocks, float* out) {
  const int64_t grain = std::max<int64_t>(1, 4096 / (blocks * block_weights(K) / 32));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    dequantize_rows<K>(begin, end, weight, blocks, out);
  });
}
