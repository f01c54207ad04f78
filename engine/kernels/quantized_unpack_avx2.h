// The 32-weight GGUF blocks (q8_0, q4_0, q4_1, q5_0, q5_1) unpacked in AVX2 registers: the same
// int8 values, scale and offset as unpack_legacy (quantized_legacy.h) gives, without a loop over
// the weights and with F16C converting the scales. The SIMD path (quantized_simd.h) uses it on
// both of its instruction sets (AVX-512's target includes AVX2).
#pragma once

#include "quantized_avx2_legacy.h"  // half_to_float_f16c
#include "quantized_legacy.h"

#if PDSERVE_HAS_X86

namespace pdserve_quantized {

// 32 bytes, byte j 0xFF where bit j of bits is set, else 0: each byte first takes the byte of
// bits holding its bit, then all other bits are set, so only a set bit makes the byte 0xFF.
PDSERVE_AVX2 inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i byte_of_bit = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                                 0x0202020202020202, 0x0303030303030303);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             byte_of_bit);
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

// The 32 values of 16 bytes of nibbles (weight j < 16 in the low nibble of byte j, j + 16 in its
// high nibble), with the 5th bits qh when given (five_bits), less bias.
PDSERVE_AVX2 inline __m256i nibble_values(const uint8_t* qs, bool five_bits, uint32_t qh,
                                          int bias) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  __m256i q = _mm256_set_m128i(high, low);
  if (five_bits) {
    const __m256i fifth = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
    q = _mm256_or_si256(q, fifth);
  }
  return _mm256_sub_epi8(q, _mm256_set1_epi8(static_cast<char>(bias)));
}

// Byte offset of the values in a block of 4-bit kind K, and the bias they carry.
constexpr int64_t nibbles_offset(Kind kind) { return kind == Kind::q4_1 ? 4 : 2; }
constexpr int nibble_bias(Kind kind) { return kind == Kind::q4_0 ? 8 : 0; }

// Vector i of 8 of a 4-bit block's 32 values, less bias: the low nibbles of bytes 0-7 (weights
// 0-7), of bytes 8-15, then the high nibbles of bytes 0-7 (weights 16-23) and of bytes 8-15.
template <Kind K>
PDSERVE_AVX2 inline __m256 nibble_vector(const uint8_t* block, int64_t i) {
  const uint8_t* qs = block + nibbles_offset(K) + 8 * (i & 1);
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i q = i < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F))
                          : _mm256_srli_epi32(bytes, 4);
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(nibble_bias(K))));
}

// A block's scale and offset, and (kValues) its int8 values in u.q; a caller reading the values
// from the block itself leaves kValues false.
template <Kind K, bool kValues = true>
PDSERVE_AVX2 inline void unpack_legacy_avx2(const uint8_t* block, Unpacked<K>& u) {
  u.scale[0] = half_to_float_f16c(block);
  u.offset[0] = has_offset(K) ? half_to_float_f16c(block + 2) : 0.f;
  if constexpr (!kValues) return;
  __m256i q;
  if constexpr (K == Kind::q8_0) {
    q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else if constexpr (K == Kind::q4_0 || K == Kind::q4_1) {
    q = nibble_values(block + nibbles_offset(K), false, 0, nibble_bias(K));
  } else if constexpr (K == Kind::q5_0) {
    q = nibble_values(block + 6, true, read_u32(block + 2), 16);
  } else {
    static_assert(K == Kind::q5_1);
    q = nibble_values(block + 8, true, read_u32(block + 4), 0);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(u.q), q);
}

constexpr bool is_legacy(Kind kind) {
  return kind == Kind::q8_0 || kind == Kind::q4_0 || kind == Kind::q4_1 || kind == Kind::q5_0 ||
         kind == Kind::q5_1;
}

}  // namespace pdserve_quantized

#endif  // PDSERVE_HAS_X86
