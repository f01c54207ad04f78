// The SIMD decode rows on 8-bit activations (quantized_int8.h), written once and included per
// instruction set: into namespace int8_avx2 (PDSERVE_TARGET AVX2, bytes multiplied by maddubs
// and widened by madd) and int8_vnni (AVX-512 VNNI on 256 bits: vpdpbusd), with
// PDSERVE_INT8_VNNI saying which. Hence no include guard.
//
// A block becomes, per 32 weights, one vector of 32 unsigned bytes u (q8_0: its signed bytes),
// and per sub-block a scale and a correction, weight = scale * u + correction; a group of 32
// weights then adds d_x * scale * dot(u, x_q) to a float accumulator lane by lane (q6_k's two
// sub-blocks of 16 in the vector's two halves), and d_x * correction * sum(x_q) to a scalar.

template <Kind K>
struct IntBlock {
  __m256i u[block_weights(K) / 32];
  float scale[sub_blocks(K)];
  float correction[sub_blocks(K)];
};

template <Kind K>
PDSERVE_TARGET inline void unpack_int(const uint8_t* block, IntBlock<K>& ib) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (K == Kind::q8_0) {
    ib.scale[0] = half_to_float_f16c(block);
    ib.correction[0] = 0.f;
    ib.u[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else if constexpr (K == Kind::q4_0 || K == Kind::q4_1) {
    const float d = half_to_float_f16c(block);
    ib.scale[0] = d;
    ib.correction[0] = K == Kind::q4_0 ? -8.f * d : half_to_float_f16c(block + 2);
    ib.u[0] = nibble_values(block + nibbles_offset(K), false, 0, 0);
  } else if constexpr (K == Kind::q5_0) {
    const float d = half_to_float_f16c(block);
    ib.scale[0] = d;
    ib.correction[0] = -16.f * d;
    ib.u[0] = nibble_values(block + 6, true, read_u32(block + 2), 0);
  } else if constexpr (K == Kind::q5_1) {
    ib.scale[0] = half_to_float_f16c(block);
    ib.correction[0] = half_to_float_f16c(block + 2);
    ib.u[0] = nibble_values(block + 8, true, read_u32(block + 4), 0);
  } else if constexpr (K == Kind::q4_k || K == Kind::q5_k) {
    const float d = half_to_float_f16c(block), dmin = half_to_float_f16c(block + 2);
    uint8_t sc[8], m[8];
    kquant_scales(block + 4, sc, m);
    for (int j = 0; j < 8; ++j) {
      ib.scale[j] = d * static_cast<float>(sc[j]);
      ib.correction[j] = -(dmin * static_cast<float>(m[j]));
    }
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
      ib.u[2 * p] = low;
      ib.u[2 * p + 1] = high;
    }
  } else {
    static_assert(K == Kind::q6_k);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_to_float_f16c(block + 208);
    for (int j = 0; j < 16; ++j) {
      ib.scale[j] = d * static_cast<float>(sc[j]);
      ib.correction[j] = -32.f * ib.scale[j];
    }
    const __m256i two_bits = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      for (int t = 0; t < 4; ++t) {
        const __m256i ql =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * (t % 2)));
        const __m256i low = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m256i high =
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), two_bits), 4);
        ib.u[4 * h + t] = _mm256_or_si256(low, high);
      }
    }
  }
}

// dot(u, x) of 32 bytes as 8 int32 lanes, lane i summing bytes 4i-4i+3; q8_0's signed weights
// meet x with its sign flipped where the weight is negative.
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

PDSERVE_TARGET inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows of x (from row m0) against weight row ``row``: out[r * ldo] for r < R.
template <Kind K, int R>
PDSERVE_TARGET void int8_row_tile(const uint8_t* row, int64_t blocks, const Int8Rows& x,
                                  int64_t m0, float* out, int64_t ldo) {
  constexpr int64_t W = block_weights(K), C = W / 32, S = sub_blocks(K);
  const int64_t groups = x.k / 32;
  __m256 acc[R];
  float corrections[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    corrections[r] = 0.f;
  }
  IntBlock<K> ib;
  for (int64_t b = 0; b < blocks; ++b) {
    unpack_int<K>(row + b * block_bytes(K), ib);
#pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) {
      const int64_t g = b * C + c;
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m256i xq =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * x.k + g * 32));
        const float dx = x.scale[m * groups + g];
        const int32_t* sums = x.sums.data() + m * 2 * groups + 2 * g;
        const __m256 products = _mm256_cvtepi32_ps(dot32<K>(ib.u[c], xq));
        if constexpr (S == C) {
          acc[r] = _mm256_fmadd_ps(products, _mm256_set1_ps(ib.scale[c] * dx), acc[r]);
          if constexpr (K != Kind::q8_0)
            corrections[r] += dx * ib.correction[c] * static_cast<float>(sums[0] + sums[1]);
        } else {  // two sub-blocks of 16: bytes 0-15 in lanes 0-3, 16-31 in lanes 4-7
          const float a = ib.scale[2 * c] * dx, z = ib.scale[2 * c + 1] * dx;
          acc[r] = _mm256_fmadd_ps(products, _mm256_setr_ps(a, a, a, a, z, z, z, z), acc[r]);
          corrections[r] += dx * (ib.correction[2 * c] * static_cast<float>(sums[0]) +
                                  ib.correction[2 * c + 1] * static_cast<float>(sums[1]));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]) + corrections[r];
}

// Outputs [begin, end) of every row of x; out row m starts at out + m * ldo.
template <Kind K>
PDSERVE_TARGET void int8_linear_rows(int64_t begin, int64_t end, const uint8_t* weight,
                                     int64_t ldo, int64_t blocks, const Int8Rows& x,
                                     float* out) {
  const int64_t row_bytes = blocks * block_bytes(K);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = weight + n * row_bytes;
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
