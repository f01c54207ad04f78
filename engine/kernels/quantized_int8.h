// Decode rows on 8-bit activations (engine config activation_dtype: int8): each row of x is
// quantized once per matmul input into groups as long as a weight block (32 values; 256 for
// the K kinds), d_x = max |x| / 127 and x_q = round(x / d_x) in int8, with the sums of x_q per
// 16; each weight block's integer values meet x_q in integer dot products, 32 bytes at a time
// (quantized_int8_simd.h: vpdpbusd under AVX-512 VNNI for the 32-weight kinds, maddubs + madd
// elsewhere and for the K kinds, whose sub-block scales the madd applies; a portable loop
// without AVX2). Per sub-block, weight = scale * q + offset (quantized_kinds.h), so a sub-block
// adds d_x * (scale * dot(q, x_q) + offset * sum(x_q)): the weights' own rounding is kept and
// only x is rounded, to 8 bits a group, as llama.cpp's Q8_0 / Q8_K activations are.
//
// This changes results beyond summation order, so it runs only where chosen
// (set_activation_dtype("int8")), for rows of x up to int8_max_rows (decode steps; more rows
// take the float32 path, whose weights, once unpacked, meet up to 8 rows each; every row count
// under set_batch_invariant(true)), and for every
// kind but the half ones. AVX-512 VNNI runs where set_isa("avx512") was given (after the probe,
// which executes a VNNI instruction where cpuid lists one) and cpuid lists VNNI.
#pragma once

#include "quantized_avx2_legacy.h"
#include "quantized_isa.h"
#include "quantized_kquants.h"
#include "quantized_scalar.h"
#include "quantized_unpack_avx2.h"

#include <cmath>

namespace pdserve_quantized {

// Rows of x [M, k] in groups of ``group`` values (32, or 256 for the 256-weight kinds): values,
// each group's scale, the sums of the values per 16, and each group's scale times its sum.
struct Int8Rows {
  int64_t M = 0, k = 0, group = 32;
  std::vector<int8_t> q;            // [M, k]
  std::vector<float> scale;         // [M, k / group]
  std::vector<int16_t> sums16;      // [M, k / 16], at most 16 * 127 each
  std::vector<float> scaled_sums;   // [M, k / group]
};

// The most rows of x a product takes on 8-bit activations (python -m benchmarks.engine.int8_rows):
// the K kinds keep integer sums a block and gain up to 8 rows; the 32-weight kinds convert to
// float every 32 weights and lose at 8 rows against the float32 path, which unpacks a block
// once for 8 rows.
constexpr int64_t int8_max_rows(Kind kind) { return block_weights(kind) == 256 ? 8 : 4; }

// The group x takes for weights of kind K: a block's own length.
constexpr int64_t int8_group(Kind kind) { return block_weights(kind) == 256 ? 256 : 32; }

inline std::atomic<bool>& int8_activations() {
  static std::atomic<bool> on{false};
  return on;
}

inline void set_activation_dtype(const std::string& name) {
  TORCH_CHECK(name == "int8" || name == "float32",
              "set_activation_dtype: 'int8' or 'float32', not '", name, "'");
  int8_activations().store(name == "int8");
}

inline std::string activation_dtype() { return int8_activations().load() ? "int8" : "float32"; }

template <Kind K>
bool uses_int8(int64_t M) {
  return !is_half(K) && int8_activations().load(std::memory_order_relaxed) &&
         (M <= int8_max_rows(K) || batch_invariant().load(std::memory_order_relaxed));
}

// One group of n values (32 or 256): its scale and values, and their sums per 16; nearbyint
// rounds half to even, as the AVX2 path's _mm256_round_ps does, so both give the same bytes.
inline void quantize_group_scalar(const float* x, int64_t n, int8_t* q, float* scale,
                                  int16_t* sums16) {
  float amax = 0.f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  *scale = amax / 127.f;
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < n / 16; ++i) {
    int sum = 0;
    for (int64_t j = 16 * i; j < 16 * (i + 1); ++j) {
      const int value = static_cast<int>(std::nearbyint(x[j] * inverse));
      q[j] = static_cast<int8_t>(value);
      sum += value;
    }
    sums16[i] = static_cast<int16_t>(sum);
  }
}

#if PDSERVE_HAS_X86
PDSERVE_AVX2 inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

PDSERVE_AVX2 inline void quantize_group_avx2(const float* x, int64_t n, int8_t* q, float* scale,
                                             int16_t* sums16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float top = _mm_cvtss_f32(m);
  *scale = top / 127.f;
  const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  for (int64_t c = 0; c < n; c += 32) {
    __m256i values[4];
    for (int i = 0; i < 4; ++i)
      values[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c + 8 * i), inverse),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sums16[c / 16] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(values[0], values[1])));
    sums16[c / 16 + 1] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(values[2], values[3])));
    // packs interleave the 128-bit halves; the permutation puts the 32 bytes back in order
    const __m256i words01 = _mm256_packs_epi32(values[0], values[1]);
    const __m256i words23 = _mm256_packs_epi32(values[2], values[3]);
    const __m256i bytes = _mm256_packs_epi16(words01, words23);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(q + c),
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}
#endif

// x [M, k] (k a multiple of group) into ``out``, in groups of ``group``.
inline void quantize_rows(const float* x, int64_t M, int64_t k, int64_t group, Int8Rows& out) {
  const int64_t groups = k / group;
  out.M = M;
  out.k = k;
  out.group = group;
  out.q.resize(M * k);
  out.scale.resize(M * groups);
  out.sums16.resize(M * k / 16);
  out.scaled_sums.resize(M * groups);
  const bool simd = current_int8_path() != Int8Path::scalar;
  for (int64_t g = 0; g < M * groups; ++g) {
    const float* xs = x + g * group;
    int8_t* q = out.q.data() + g * group;
    int16_t* sums16 = out.sums16.data() + g * group / 16;
#if PDSERVE_HAS_X86
    if (simd)
      quantize_group_avx2(xs, group, q, &out.scale[g], sums16);
    else
#endif
      quantize_group_scalar(xs, group, q, &out.scale[g], sums16);
    int32_t sum = 0;
    for (int64_t i = 0; i < group / 16; ++i) sum += sums16[i];
    out.scaled_sums[g] = out.scale[g] * static_cast<float>(sum);
  }
}

// The portable path: each block's integer values (quantized_kinds.h) against x_q, per
// sub-block d_x * (scale * dot(q, x_q) + offset * sum(x_q)).
template <Kind K>
void int8_linear_rows_scalar(int64_t begin, int64_t end, const uint8_t* weight, int64_t ldo,
                             int64_t blocks, const Int8Rows& x, float* out) {
  constexpr int64_t W = block_weights(K), S = sub_blocks(K), SW = sub_weights(K);
  const int64_t row_bytes = blocks * block_bytes(K), groups = x.k / x.group;
  Unpacked<K> u;
  for (int64_t n = begin; n < end; ++n)
    for (int64_t m = 0; m < x.M; ++m) {
      float sum = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        unpack<K>(weight + n * row_bytes + b * block_bytes(K), u);
        for (int64_t s = 0; s < S; ++s) {
          const int64_t first = b * W + s * SW;  // the sub-block's first weight in the row
          const int8_t* xq = x.q.data() + m * x.k + first;
          int32_t dot = 0;
          for (int64_t j = 0; j < SW; ++j) dot += static_cast<int32_t>(u.q[s * SW + j]) * xq[j];
          const int16_t* sums = x.sums16.data() + (m * x.k + first) / 16;
          const int32_t x_sum = SW == 32 ? sums[0] + sums[1] : sums[0];
          sum += x.scale[m * groups + first / x.group] *
                 (u.scale[s] * static_cast<float>(dot) + u.offset[s] * static_cast<float>(x_sum));
        }
      }
      out[m * ldo + n] = sum;
    }
}

#if PDSERVE_HAS_X86
namespace int8_avx2 {
#define PDSERVE_TARGET PDSERVE_AVX2
#define PDSERVE_INT8_VNNI 0
#include "quantized_int8_simd.h"
#undef PDSERVE_INT8_VNNI
#undef PDSERVE_TARGET
}  // namespace int8_avx2

namespace int8_vnni {
#define PDSERVE_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define PDSERVE_INT8_VNNI 1
#include "quantized_int8_simd.h"
#undef PDSERVE_INT8_VNNI
#undef PDSERVE_TARGET
}  // namespace int8_vnni
#endif

// Which integer path runs now: "vnni", "avx2" or "scalar".
inline const char* int8_path() {
  const Int8Path path = current_int8_path();
  return path == Int8Path::vnni ? "vnni" : path == Int8Path::avx2 ? "avx2" : "scalar";
}

template <Kind K>
void int8_linear_rows_any(int64_t begin, int64_t end, const uint8_t* weight, int64_t ldo,
                          int64_t blocks, const Int8Rows& x, float* out) {
  if constexpr (!is_half(K)) {
#if PDSERVE_HAS_X86
    const Int8Path path = current_int8_path();
    if (path == Int8Path::vnni)
      return int8_vnni::int8_linear_rows<K>(begin, end, weight, ldo, blocks, x, out);
    if (path == Int8Path::avx2)
      return int8_avx2::int8_linear_rows<K>(begin, end, weight, ldo, blocks, x, out);
#endif
    int8_linear_rows_scalar<K>(begin, end, weight, ldo, blocks, x, out);
  } else {
    TORCH_CHECK(false, "8-bit activations meet only integer weight kinds");
  }
}

}  // namespace pdserve_quantized
