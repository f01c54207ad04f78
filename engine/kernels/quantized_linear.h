// Weight-only quantized linear layers on GGUF blocks: out[m, n] = dot(x[m], w[n]), where x is
// float32 and w is stored block for block as ggml stores it (the kinds: quantized_kinds.h).
//
// Activations stay float32, so results differ from x @ dequantize(w).T only by the rounding of
// float32 sums taken in another order; where set_activation_dtype("int8") chose 8-bit
// activations, rows of up to int8_max_rows take quantized_int8.h instead. Work is split over
// output features with at::parallel_for, on torch's threads.
//
// Three paths, chosen at run time: AVX-512 (F, BW, VL; quantized_simd.h on 16 lanes), AVX2 +
// FMA + F16C (quantized_avx2_legacy.h for Q4_1, quantized_simd.h on 8 lanes for the rest) and
// portable scalar code (quantized_scalar.h). The SIMD path unpacks the 32-weight kinds
// in registers (quantized_unpack_avx2.h): one row of a [3072, 576] matrix on one Zen 4 thread,
// AVX-512 / AVX2, in ms: q5_0 0.10 / 0.18, q5_1 0.11 / 0.18, q4_0 0.09 / 0.14, q8_0 0.06 / 0.08
// (0.21 / 0.32, 1.1 / 1.4 and 1.3 / 1.3 for q5_0, q5_1 and q4_0 with the unpacking loop; q4_1
// 0.10 either way, so it takes the SIMD path under AVX-512 too). set_isa("auto") picks AVX2 or scalar by
// CPU features and never AVX-512: cpuid may list instructions a virtual machine faults on, so
// AVX-512 runs only once set_isa("avx512") asks for it, which the caller does after
// avx512_probe() ran safely (in a child process).
#pragma once

#include "quantized_avx2_legacy.h"
#include "quantized_int8.h"
#include "quantized_isa.h"
#include "quantized_scalar.h"
#include "quantized_unpack_avx2.h"
#include "quantized_vectors.h"

namespace pdserve_quantized {

#if PDSERVE_HAS_X86
namespace simd_avx2 {
using V = Avx2Vectors;
#define PDSERVE_TARGET PDSERVE_AVX2
#include "quantized_simd.h"
#undef PDSERVE_TARGET
}  // namespace simd_avx2

namespace simd_avx512 {
using V = Avx512Vectors;
#define PDSERVE_TARGET PDSERVE_AVX512
#include "quantized_simd.h"
#undef PDSERVE_TARGET
}  // namespace simd_avx512
#endif

// The kernel that computes kind K on an instruction set.
enum class KernelPath { scalar, legacy_avx2, simd_avx2, simd_avx512 };

template <Kind K>
KernelPath kernel_path(Isa isa) {
#if PDSERVE_HAS_X86
  if (isa == Isa::avx512) return KernelPath::simd_avx512;
  if (isa == Isa::scalar) return KernelPath::scalar;
  if (K == Kind::q4_1) return KernelPath::legacy_avx2;
  if (isa == Isa::avx2) return KernelPath::simd_avx2;
#endif
  return KernelPath::scalar;
}

template <Kind K>
void linear(const uint8_t* weight, int64_t N, int64_t blocks, const float* x, int64_t M,
            float* out) {
  const int64_t work_per_row = std::max<int64_t>(1, blocks * block_weights(K) * M);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / work_per_row);
  if (uses_int8<K>(M)) {  // quantized_int8.h: x in 8-bit groups, once for every thread
    Int8Rows xq;
    quantize_rows(x, M, blocks * block_weights(K), int8_group(K), xq);
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      int8_linear_rows_any<K>(begin, end, weight, N, blocks, xq, out);
    });
    return;
  }
  switch (kernel_path<K>(current_isa())) {
#if PDSERVE_HAS_X86
    case KernelPath::simd_avx512:
      return simd_avx512::linear<K>(weight, N, blocks, x, M, out, grain);
    case KernelPath::legacy_avx2:
      if constexpr (K == Kind::q4_1)
        return linear_avx2<K>(weight, N, blocks, x, M, out, grain);
      break;
    case KernelPath::simd_avx2:
      if constexpr (K != Kind::q4_1)
        return simd_avx2::linear<K>(weight, N, blocks, x, M, out, grain);
      break;
#endif
    default:
      break;
  }
  linear_scalar<K>(weight, N, blocks, x, M, out, grain);
}

template <Kind K>
void dequantize(const uint8_t* weight, int64_t N, int64_t blocks, float* out) {
#if PDSERVE_HAS_X86
  const Isa isa = current_isa();
  if (isa == Isa::avx512) return simd_avx512::dequantize<K>(weight, N, blocks, out);
  if constexpr (K == Kind::q4_1) {
    if (isa == Isa::avx2) return dequantize_avx2<K>(weight, N, blocks, out);
  } else if constexpr (K == Kind::q6_k) {
    // the 8-lane SIMD dequantization of q6_k left its output unwritten in a build for Zen 3
    // (GCC 12, -O3 -march=native; tests/engine/kernels: dequantizes_as_gguf_does[avx2-q6_k]):
    // the portable path, until that is understood
  } else {
    if (isa == Isa::avx2) return simd_avx2::dequantize<K>(weight, N, blocks, out);
  }
#endif
  dequantize_scalar<K>(weight, N, blocks, out);
}

// Calls f with the kind as a template argument: f(std::integral_constant<Kind, K>{}).
template <class Fn>
void with_kind(Kind kind, Fn&& f) {
  switch (kind) {
    case Kind::q8_0: return f(std::integral_constant<Kind, Kind::q8_0>{});
    case Kind::q4_0: return f(std::integral_constant<Kind, Kind::q4_0>{});
    case Kind::q4_1: return f(std::integral_constant<Kind, Kind::q4_1>{});
    case Kind::q5_0: return f(std::integral_constant<Kind, Kind::q5_0>{});
    case Kind::q5_1: return f(std::integral_constant<Kind, Kind::q5_1>{});
    case Kind::q4_k: return f(std::integral_constant<Kind, Kind::q4_k>{});
    case Kind::q5_k: return f(std::integral_constant<Kind, Kind::q5_k>{});
    case Kind::q6_k: return f(std::integral_constant<Kind, Kind::q6_k>{});
    case Kind::f16: return f(std::integral_constant<Kind, Kind::f16>{});
    case Kind::bf16: return f(std::integral_constant<Kind, Kind::bf16>{});
  }
}

// out [M, N] = x [M, k] . w^T for weight blocks w [N, k / block weights * block bytes], where k
// is a multiple of the kind's block weights.
inline void quantized_matmul(const float* x, int64_t M, const uint8_t* w, Kind kind, int64_t N,
                             int64_t k, float* out) {
  with_kind(kind, [&](auto K) { linear<K.value>(w, N, k / block_weights(K.value), x, M, out); });
}

// quantized_matmul split by the caller (one parallel region over many products, each thread
// taking its own output features): prepare_matmul_rows fills a RowScratch once per x (each
// thread may fill its own): x in 8-bit groups where those kernels run (quantized_int8.h), or the
// sub-block sums a lone float32 row takes; quantized_matmul_rows then computes
// out[m * ldo + n] for n in [begin, end), the same sums in the same order as quantized_matmul
// gives them. Both choose the kernel by the instruction set and activation dtype selected now.
struct RowScratch {
  std::vector<float> x_sums;
  Int8Rows int8;
  bool int8_ready = false;  // int8 holds x: the 8-bit path computes
};

template <Kind K>
void prepare_rows(const float* x, int64_t M, int64_t blocks, RowScratch& scratch) {
  scratch.int8_ready = uses_int8<K>(M);
  scratch.x_sums.clear();
  if (scratch.int8_ready)
    return quantize_rows(x, M, blocks * block_weights(K), int8_group(K), scratch.int8);
  switch (kernel_path<K>(current_isa())) {
#if PDSERVE_HAS_X86
    case KernelPath::simd_avx512: return simd_avx512::prepare_x_sums<K>(x, M, blocks, scratch.x_sums);
    case KernelPath::simd_avx2: return simd_avx2::prepare_x_sums<K>(x, M, blocks, scratch.x_sums);
    case KernelPath::legacy_avx2: return prepare_x_sum_pairs<K>(x, M, blocks, scratch.x_sums);
#endif
    default: return;
  }
}

template <Kind K>
void linear_rows_any(int64_t begin, int64_t end, const uint8_t* weight, int64_t ldo,
                     int64_t blocks, const float* x, int64_t M, const RowScratch& scratch,
                     float* out) {
  if (scratch.int8_ready)
    return int8_linear_rows_any<K>(begin, end, weight, ldo, blocks, scratch.int8, out);
  switch (kernel_path<K>(current_isa())) {
#if PDSERVE_HAS_X86
    case KernelPath::simd_avx512:
      return simd_avx512::linear_rows<K>(begin, end, weight, ldo, blocks, x, M,
                                              scratch.x_sums.data(), out);
    case KernelPath::legacy_avx2:
      if constexpr (K == Kind::q4_1)
        return linear_rows_avx2<K>(begin, end, weight, ldo, blocks, x, M,
                                   scratch.x_sums.data(), out);
      break;
    case KernelPath::simd_avx2:
      if constexpr (K != Kind::q4_1)
        return simd_avx2::linear_rows<K>(begin, end, weight, ldo, blocks, x, M,
                                              scratch.x_sums.data(), out);
      break;
#endif
    default:
      break;
  }
  linear_rows_scalar<K>(begin, end, weight, ldo, blocks, x, M, out);
}

inline void prepare_matmul_rows(const float* x, int64_t M, Kind kind, int64_t k,
                                RowScratch& scratch) {
  with_kind(kind,
            [&](auto K) { prepare_rows<K.value>(x, M, k / block_weights(K.value), scratch); });
}

inline void quantized_matmul_rows(const float* x, int64_t M, const uint8_t* w, Kind kind,
                                  int64_t k, int64_t begin, int64_t end, float* out, int64_t ldo,
                                  const RowScratch& scratch) {
  with_kind(kind, [&](auto K) {
    linear_rows_any<K.value>(begin, end, w, ldo, k / block_weights(K.value), x, M, scratch, out);
  });
}

// weight [N, k / block weights * block bytes] as float32 [N, k] in out.
inline void dequantize_matrix(const uint8_t* w, Kind kind, int64_t N, int64_t k, float* out) {
  with_kind(kind, [&](auto K) { dequantize<K.value>(w, N, k / block_weights(K.value), out); });
}

// The instruction-set functions every module built on this header exposes (each module holds
// its own choice).
inline void bind_isa_functions(pybind11::module_& m) {
  m.def("set_isa", &set_isa,
        "'avx512', 'avx2' or 'scalar' forces that path; 'auto' picks AVX2 or scalar by CPU");
  m.def("isa", [] { return std::string(isa_name(current_isa())); },
        "The path the quantized kernels run now: 'avx512', 'avx2' or 'scalar'");
  m.def("avx2_supported", &cpu_has_avx2, "Whether this CPU has AVX2, FMA and F16C");
  m.def("avx512_supported", &cpu_lists_avx512, "Whether cpuid lists AVX-512 F, BW and VL");
  m.def("avx512_probe", &avx512_probe,
        "Runs a few AVX-512 F/BW/VL (and VNNI) instructions and checks them (may die of SIGILL)");
  m.def("set_activation_dtype", &set_activation_dtype,
        "'int8': decode rows quantize x to 8-bit groups (integer dot products); 'float32'");
  m.def("activation_dtype", &activation_dtype, "'int8' or 'float32'");
  m.def("set_batch_invariant", &set_batch_invariant,
        "true: 8-bit activations take every row count (a row's result never depends on M)");
  m.def("int8_path", [] { return std::string(int8_path()); },
        "The path 8-bit activations take now: 'vnni', 'avx2' or 'scalar'");
}

}  // namespace pdserve_quantized
