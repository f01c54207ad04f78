// The SIMD path for every kind, written once over a vector type V (quantized_vectors.h) and a
// target attribute PDSERVE_TARGET, and included once per instruction set by quantized_linear.h
// (into namespaces simd_avx2 and simd_avx512; hence no include guard).
//
// Each block is unpacked into int8 values and per-sub-block scales (quantized_kinds.h), each
// sub-block turned into float weights in registers, bit for bit as ggml dequantizes them (half
// weights are widened as they are), and multiplied against a tile of up to 8 rows of x (4 on 8
// lanes). Each row is summed exactly as it would be alone (rows_dot), so a row's result never
// depends on the rows beside it: one decode row gives the same logits in any batch. A lone row
// that need not be batch invariant (no speculation) takes row_dot, which applies the scales
// per sub-block: fewer operations, another order.

using F = V::F;

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
  if constexpr (has_offset(K)) offsets = std::fma(u.offset[s], x_sums[s], offsets);
}

// One row of x against one weight row over blocks [b0, b1), with x's sub-block sums, the scales
// applied per sub-block (fewer operations than rows_dot, another order of summation: the single
// row of a step that need not be batch invariant). Even and odd sub-blocks go to separate
// accumulators, so consecutive ones do not wait on each other.
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

// Rows of x a tile takes, and the accumulators (FMA chains) of each row: 8 rows of 2 chains
// keep 16 of AVX-512's 32 registers; AVX2's 16 hold 8 rows of 1 (a lone row not batch
// invariant takes row_dot, which has 2).
constexpr int64_t kTileRows = 8;
constexpr int kChains = V::L == 16 ? 2 : 1;

// R rows of x against one weight row of `blocks` blocks: each sub-block becomes its float
// weights once, in registers, bit for bit as ggml dequantizes them, and meets all R rows. Each
// row's sum is taken in one order whatever R is, so a row gives the same bits alone or in any
// tile (batch invariance): a block's vectors alternate between two accumulators (a block holds
// an even number of vectors, so the alternation is the same in every block), and the sum is
// hsum(first + second), stored in out.
template <Kind K, int R>
PDSERVE_TARGET void rows_dot(const uint8_t* row, int64_t blocks, const float* x, int64_t ldx,
                             float* out, int64_t ldo) {
  constexpr int64_t W = block_weights(K), S = sub_blocks(K), SW = sub_weights(K);
  constexpr int64_t vectors = SW / V::L;
  static_assert((W / V::L) % kChains == 0, "a block's vectors share the chains alike");
  F acc[R][kChains];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = V::zero();
  Unpacked<K> u;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes(K);
    unpack_block<K>(block, u);
#pragma GCC unroll 16
    for (int64_t s = 0; s < S; ++s) {
      F w[vectors];
#pragma GCC unroll 4
      for (int64_t i = 0; i < vectors; ++i) w[i] = weights<K>(block, u, s, s * vectors + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + b * W + s * SW;
#pragma GCC unroll 4
        for (int64_t i = 0; i < vectors; ++i) {
          F& chain = acc[r][(s * vectors + i) % kChains];
          chain = V::fmadd(w[i], V::load(xr + i * V::L), chain);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    F total = acc[r][0];
    if constexpr (kChains == 2) total = V::add(total, acc[r][1]);
    out[r * ldo] = V::hsum(total);
  }
}


template <Kind K>
PDSERVE_TARGET void rows_dot_any(int rows, const uint8_t* row, int64_t blocks, const float* x,
                                 int64_t ldx, float* out, int64_t ldo) {
  switch (rows) {
#define PDSERVE_ROWS(R)                                                         \
  case R:                                                                       \
    if constexpr (R <= kTileRows) return rows_dot<K, R>(row, blocks, x, ldx, out, ldo); \
    break;
    PDSERVE_ROWS(1) PDSERVE_ROWS(2) PDSERVE_ROWS(3) PDSERVE_ROWS(4)
    PDSERVE_ROWS(5) PDSERVE_ROWS(6) PDSERVE_ROWS(7) PDSERVE_ROWS(8)
#undef PDSERVE_ROWS
    default: break;
  }
  TORCH_CHECK(false, "row tile of ", rows, " rows");
}

// Outputs [begin, end) for all M rows of x, a chunk of weight rows at a time: each weight row
// meets every tile of x rows while it is in L1 (whole rows: a row split into segments of K
// would add each segment's sum to the last, an order a single row would have to follow too,
// and it measured no faster for tiles here).
template <Kind K>
PDSERVE_TARGET void linear_rows(int64_t begin, int64_t end, const uint8_t* weight, int64_t N,
                                int64_t blocks, const float* x, int64_t M, const float* x_sums,
                                float* out) {
  const int64_t row_bytes = blocks * block_bytes(K), row_weights = blocks * block_weights(K);
  if (M == 1 && !batch_invariant().load(std::memory_order_relaxed)) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = weight + n * row_bytes;
      prefetch_row_ahead<K>(row, n, end, row_bytes, 0, blocks);
      out[n] = row_dot<K>(row, 0, blocks, x, x_sums);
    }
    return;
  }
  for (int64_t n0 = begin; n0 < end; n0 += kWeightRowChunk) {
    const int64_t n1 = std::min(end, n0 + kWeightRowChunk);
    for (int64_t m = 0; m < M; m += kTileRows) {
      const int rows = static_cast<int>(std::min(kTileRows, M - m));
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = weight + n * row_bytes;
        if (m == 0) prefetch_row_ahead<K>(row, n, end, row_bytes, 0, blocks);
        rows_dot_any<K>(rows, row, blocks, x + m * row_weights, row_weights, out + m * N + n, N);
      }
    }
  }
}

// The sub-block sums of x that row_dot needs (one row, kinds with offsets, not batch
// invariant); x_sums is left empty otherwise.
template <Kind K>
void prepare_x_sums(const float* x, int64_t M, int64_t blocks, std::vector<float>& x_sums) {
  x_sums.clear();
  if (!has_offset(K) || M != 1 || batch_invariant().load()) return;
  const int64_t subs = blocks * sub_blocks(K), SW = sub_weights(K);
  x_sums.assign(subs, 0.f);
  for (int64_t s = 0; s < subs; ++s) {
    float sum = 0.f;
    for (int64_t j = 0; j < SW; ++j) sum += x[s * SW + j];
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
