// The SIMD decode rows on 8-bit activations (quantized_int8.h), written once and included per
// instruction set: into namespace int8_avx2 (PDSERVE_TARGET AVX2) and int8_vnni (AVX-512 VNNI
// on 256 bits), with PDSERVE_INT8_VNNI saying which. Hence no include guard.
//
// 32-weight kinds (x in groups of 32): a block's 32 unsigned values u (q8_0: its signed bytes)
// meet x_q in one dot product, vpdpbusd or maddubs + madd; the block adds
// d_x * d * dot(u, x_q) to a float accumulator (two, alternating, so that consecutive blocks do
// not wait on each other) and d_x * correction * sum(x_q) to a scalar, where
// weight = d * u + correction.
//
// 256-weight kinds (x in groups of 256, one d_x a block, as llama.cpp's Q8_K): each 32 values
// meet x_q in maddubs (u8 x s8 into int16 pairs, which cannot overflow: u < 64, |x_q| <= 127),
// then madd with the sub-block's integer scale (q6_k: one per 16 bytes) sums them into int32
// lanes already scaled; a block's integer sum is converted once and adds
// d_x * d * sum_j sc_j dot(u_j, x_q) to the float accumulator, and its correction
// (-dmin m_j, -32 d sc_j for q6_k) comes from x's sums per 16 in one more madd.

// A 32-weight block: its values, d and correction.
struct LegacyBlock {
  __m256i u;
  float d, correction;
};

template <Kind K>
PDSERVE_TARGET inline LegacyBlock unpack_legacy_int(const uint8_t* block) {
  const float d = half_to_float_f16c(block);
  if constexpr (K == Kind::q8_0)
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)), d, 0.f};
  else if constexpr (K == Kind::q4_0)
    return {nibble_values(block + 2, false, 0, 0), d, -8.f * d};
  else if constexpr (K == Kind::q4_1)
    return {nibble_values(block + 4, false, 0, 0), d, half_to_float_f16c(block + 2)};
  else if constexpr (K == Kind::q5_0)
    return {nibble_values(block + 6, true, read_u32(block + 2), 0), d, -16.f * d};
  else
    return {nibble_values(block + 8, true, read_u32(block + 4), 0), d,
            half_to_float_f16c(block + 2)};
}

// dot(u, x) of 32 bytes as 8 int32 lanes; q8_0's signed weights meet x with its sign flipped
// where the weight is negative.
template <Kind K>
PDSERVE_TARGET inline __m256i dot32(__m256i u, __m256i x) {
  if constexpr (K == Kind::q8_0) {
    x = _mm256_sign_epi8(x, u);
    u = _mm256_abs_epi8(u);
  }
#if PDSERVE_INT8_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// A 256-weight block: 8 vectors of 32 unsigned values, each vector's int16 multipliers, the
// int16 multipliers of x's 16 sums per 16 for the correction, and d, and the correction's d.
struct KBlock {
  __m256i u[8];
  __m256i multiplier[8];
  __m256i sum_multiplier;
  float d, correction_d;
};

template <Kind K>
PDSERVE_TARGET inline void unpack_kquant_int(const uint8_t* block, KBlock& kb) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (K == Kind::q4_k || K == Kind::q5_k) {
    kb.d = half_to_float_f16c(block);
    kb.correction_d = -half_to_float_f16c(block + 2);
    uint8_t sc[8], m[8];
    kquant_scales(block + 4, sc, m);
    for (int j = 0; j < 8; ++j) kb.multiplier[j] = _mm256_set1_epi16(sc[j]);
    kb.sum_multiplier = _mm256_setr_epi16(m[0], m[0], m[1], m[1], m[2], m[2], m[3], m[3], m[4],
                                          m[4], m[5], m[5], m[6], m[6], m[7], m[7]);
    const uint8_t* qs = block + (K == Kind::q5_k ? 48 : 16);
    for (int p = 0; p < 4; ++p) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i low = _mm256_and_si256(packed, low4);
      __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      if constexpr (K == Kind::q5_k) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
        const __m256i fifth = _mm256_set1_epi8(0x10);
        const __m256i bit_low = _mm256_set1_epi8(static_cast<char>(1 << (2 * p)));
        const __m256i bit_high = _mm256_set1_epi8(static_cast<char>(1 << (2 * p + 1)));
        const __m256i has_low = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_low), bit_low);
        const __m256i has_high = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_high), bit_high);
        low = _mm256_or_si256(low, _mm256_and_si256(has_low, fifth));
        high = _mm256_or_si256(high, _mm256_and_si256(has_high, fifth));
      }
      kb.u[2 * p] = low;
      kb.u[2 * p + 1] = high;
    }
  } else {
    static_assert(K == Kind::q6_k);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    kb.d = half_to_float_f16c(block + 208);
    kb.correction_d = -32.f * kb.d;
    const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    kb.sum_multiplier = _mm256_cvtepi8_epi16(scales8);
    for (int c = 0; c < 8; ++c)
      kb.multiplier[c] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * c + 1]), _mm_set1_epi16(sc[2 * c]));
    const __m256i two_bits = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      for (int t = 0; t < 4; ++t) {
        const __m256i ql =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * (t % 2)));
        const __m256i low = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m256i high =
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), two_bits), 4);
        kb.u[4 * h + t] = _mm256_or_si256(low, high);
      }
    }
  }
}

PDSERVE_TARGET inline int32_t hsum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

PDSERVE_TARGET inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Block b of a 32-weight kind against R rows of x: into chain ``chain`` of each row's pair of
// accumulators (even and odd blocks alternate, so that one block's sum does not wait on the
// previous one), its correction into the row's scalar.
template <Kind K, int R>
PDSERVE_TARGET inline void add_legacy_block(const LegacyBlock& lb, int64_t b, const Int8Rows& x,
                                            int64_t m0, int64_t groups, __m256 (&acc)[R][2],
                                            int chain, float (&corrections)[R]) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const __m256i xq =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * x.k + b * 32));
    const __m256 products = _mm256_cvtepi32_ps(dot32<K>(lb.u, xq));
    acc[r][chain] = _mm256_fmadd_ps(products, _mm256_set1_ps(lb.d * x.scale[m * groups + b]),
                                    acc[r][chain]);
    if constexpr (K != Kind::q8_0)
      corrections[r] = std::fma(lb.correction, x.scaled_sums[m * groups + b], corrections[r]);
  }
}

// R rows of x (from row m0) against weight row ``row``: out[r * ldo] for r < R.
template <Kind K, int R>
PDSERVE_TARGET void int8_row_tile(const uint8_t* row, int64_t blocks, const Int8Rows& x,
                                  int64_t m0, float* out, int64_t ldo) {
  const int64_t groups = x.k / x.group;
  __m256 acc[R][2];
  float corrections[R];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    corrections[r] = 0.f;
  }
  if constexpr (block_weights(K) == 32) {
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
      const uint8_t* block = row + b * block_bytes(K);
      add_legacy_block<K, R>(unpack_legacy_int<K>(block), b, x, m0, groups, acc, 0, corrections);
      add_legacy_block<K, R>(unpack_legacy_int<K>(block + block_bytes(K)), b + 1, x, m0, groups,
                             acc, 1, corrections);
    }
    if (b < blocks)
      add_legacy_block<K, R>(unpack_legacy_int<K>(row + b * block_bytes(K)), b, x, m0, groups,
                             acc, 0, corrections);
  } else {
    KBlock kb;
    for (int64_t b = 0; b < blocks; ++b) {  // a block's integer sums are long enough a chain
      unpack_kquant_int<K>(row + b * block_bytes(K), kb);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* xq = x.q.data() + m * x.k + b * 256;
        __m256i sums = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * c));
          const __m256i pairs = _mm256_maddubs_epi16(kb.u[c], xv);
          sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, kb.multiplier[c]));
        }
        const float dx = x.scale[m * groups + b];
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(kb.d * dx), acc[r][0]);
        const __m256i x_sums = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.sums16.data() + m * (x.k / 16) + b * 16));
        const int32_t correction = hsum_lanes(_mm256_madd_epi16(x_sums, kb.sum_multiplier));
        corrections[r] = std::fma(kb.correction_d * dx, static_cast<float>(correction),
                                  corrections[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    out[r * ldo] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + corrections[r];
}

// Outputs [begin, end) of every row of x; out row m starts at out + m * ldo.
template <Kind K>
PDSERVE_TARGET void int8_linear_rows(int64_t begin, int64_t end, const uint8_t* weight,
                                     int64_t ldo, int64_t blocks, const Int8Rows& x,
                                     float* out) {
  const int64_t row_bytes = blocks * block_bytes(K);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = weight + n * row_bytes;
    prefetch_row_ahead<K>(row, n, end, row_bytes, 0, blocks);
    int64_t m = 0;
    for (; m + 4 <= x.M; m += 4) int8_row_tile<K, 4>(row, blocks, x, m, out + m * ldo + n, ldo);
    switch (x.M - m) {
      case 3: int8_row_tile<K, 3>(row, blocks, x, m, out + m * ldo + n, ldo); break;
      case 2: int8_row_tile<K, 2>(row, blocks, x, m, out + m * ldo + n, ldo); break;
      case 1: int8_row_tile<K, 1>(row, blocks, x, m, out + m * ldo + n, ldo); break;
      default: break;
    }
  }
}
