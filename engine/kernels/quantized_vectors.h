// The float vectors the SIMD path (quantized_simd.h) is written in: 8 lanes of AVX2 + FMA +
// F16C, or 16 lanes of AVX-512 (F, BW, VL). Each function carries its instruction set as a
// target attribute, so the library builds and loads on CPUs without AVX-512; those functions are
// then never called. avx512_probe() runs a few AVX-512 F/BW/VL instructions and checks what they
// give: a CPU (or virtual machine) whose cpuid lists AVX-512 but faults on it dies there, which
// the caller tests in a child process before choosing the path.
#pragma once

#include "quantized_kinds.h"

#if PDSERVE_HAS_X86

namespace pdserve_quantized {

struct Avx2Vectors {
  using F = __m256;
  static constexpr int64_t L = 8;
  PDSERVE_AVX2 static F zero() { return _mm256_setzero_ps(); }
  PDSERVE_AVX2 static F set1(float v) { return _mm256_set1_ps(v); }
  PDSERVE_AVX2 static F load(const float* p) { return _mm256_loadu_ps(p); }
  PDSERVE_AVX2 static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  PDSERVE_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  PDSERVE_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  PDSERVE_AVX2 static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  PDSERVE_AVX2 static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  PDSERVE_AVX2 static F from_i8(const int8_t* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
  PDSERVE_AVX2 static F from_f16(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  PDSERVE_AVX2 static F from_bf16(const uint8_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
};

struct Avx512Vectors {
  using F = __m512;
  static constexpr int64_t L = 16;
  PDSERVE_AVX512 static F zero() { return _mm512_setzero_ps(); }
  PDSERVE_AVX512 static F set1(float v) { return _mm512_set1_ps(v); }
  PDSERVE_AVX512 static F load(const float* p) { return _mm512_loadu_ps(p); }
  PDSERVE_AVX512 static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  PDSERVE_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  PDSERVE_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  PDSERVE_AVX512 static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  PDSERVE_AVX512 static float hsum(F v) {
    const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return Avx2Vectors::hsum(s);
  }
  PDSERVE_AVX512 static F from_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  PDSERVE_AVX512 static F from_f16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  PDSERVE_AVX512 static F from_bf16(const uint8_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};

// Byte adds and compares (BW), a masked 256-bit add (VL) and a float reduction (F) on known
// values; true when every one gives what it must.
PDSERVE_AVX512 inline bool run_avx512_probe() {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i twos = _mm512_add_epi8(ones, ones);
  const __mmask64 equal = _mm512_cmpeq_epi8_mask(twos, _mm512_set1_epi8(2));
  const __m256i lanes = _mm256_mask_add_epi32(_mm256_setzero_si256(), 0x0F, _mm256_set1_epi32(3),
                                              _mm256_set1_epi32(4));
  const int lane_sum = _mm256_extract_epi32(lanes, 0) + _mm256_extract_epi32(lanes, 7);
  const float total = _mm512_reduce_add_ps(_mm512_set1_ps(0.5f));
  return equal == ~__mmask64{0} && lane_sum == 7 && total == 8.f;
}

// A VNNI dot product of bytes on 256 bits (AVX-512 VNNI + VL) on known values.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) inline bool
run_avx512_vnni_probe() {
  const __m256i sums = _mm256_dpbusd_epi32(_mm256_set1_epi32(1), _mm256_set1_epi8(3),
                                           _mm256_set1_epi8(-2));
  return _mm256_extract_epi32(sums, 0) == 1 - 24 && _mm256_extract_epi32(sums, 7) == 1 - 24;
}

}  // namespace pdserve_quantized

#endif  // PDSERVE_HAS_X86
