// The GGUF block kinds the quantized kernels compute on, their sizes, and what every path shares:
// a block unpacked into integer values q with, per sub-block, a scale and an offset such that
// each weight is scale * q + offset exactly as ggml's dequantization rounds it.
//
//   kind   weights bytes  sub-block  weight
//   q8_0      32     34      32      d * q                       (q int8)
//   q4_0      32     18      32      d * (q - 8)                 (q 4 bits)
//   q4_1      32     20      32      d * q + m
//   q5_0      32     22      32      d * (q - 16)                (q 5 bits, 5th bits in qh)
//   q5_1      32     24      32      d * q + m
//   q4_k     256    144      32      d * sc_j * q - dmin * m_j   (6-bit sc_j, m_j)
//   q5_k     256    176      32      d * sc_j * q - dmin * m_j
//   q6_k     256    210      16      d * sc_j * (q - 32)         (int8 sc_j)
//   f16       32     64      32      the half itself
//   bf16      32     64      32      the bfloat16 itself
//
// The products d * sc_j, d * sc_j * q and dmin * m_j are exact in float32 for q4_k and q5_k, so
// fma(scale, q, offset) rounds once, as ggml's d * q - dm does; q6_k's d * sc_j * q is one
// rounded product, which scale * q reproduces.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PDSERVE_HAS_X86 1
#define PDSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PDSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#else
#define PDSERVE_HAS_X86 0
#endif

namespace pdserve_quantized {

enum class Kind { q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, f16, bf16 };

struct Format {
  const char* name;
  int64_t weights, bytes, sub_weights;
  bool has_offset;  // weights are scale * q + offset (else scale * q, or the value itself)
};

constexpr Format kFormats[] = {
    {"q8_0", 32, 34, 32, false},  {"q4_0", 32, 18, 32, false}, {"q4_1", 32, 20, 32, true},
    {"q5_0", 32, 22, 32, false},  {"q5_1", 32, 24, 32, true},  {"q4_k", 256, 144, 32, true},
    {"q5_k", 256, 176, 32, true}, {"q6_k", 256, 210, 16, false}, {"f16", 32, 64, 32, false},
    {"bf16", 32, 64, 32, false},
};

constexpr const Format& format(Kind kind) { return kFormats[static_cast<int>(kind)]; }
constexpr int64_t block_weights(Kind kind) { return format(kind).weights; }
constexpr int64_t block_bytes(Kind kind) { return format(kind).bytes; }
constexpr int64_t sub_weights(Kind kind) { return format(kind).sub_weights; }
constexpr int64_t sub_blocks(Kind kind) { return block_weights(kind) / sub_weights(kind); }
constexpr bool has_offset(Kind kind) { return format(kind).has_offset; }
// Half-precision weights are read as they are: no integer values, no scales.
constexpr bool is_half(Kind kind) { return kind == Kind::f16 || kind == Kind::bf16; }

inline Kind parse_kind(const std::string& name) {
  for (int i = 0; i < static_cast<int>(std::size(kFormats)); ++i)
    if (name == kFormats[i].name) return static_cast<Kind>(i);
  TORCH_CHECK(false, "unknown quantization kind '", name,
              "' (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, f16 or bf16)");
}

// Weight rows handled together (they stay in L1 while every tile of x rows meets them).
constexpr int64_t kWeightRowChunk = 16;
// Weight rows a product asks the memory for ahead of the row it computes. A decode step reads
// every weight from memory once, and the hardware prefetchers stop at each 4 KiB page, so the
// kernels without this wait on memory at a fraction of its bandwidth (python -m
// benchmarks.engine.decode_limit).
constexpr int64_t kPrefetchRows = 4;

// Asks for the cache lines of [begin, begin + bytes) to be read (a hint; nothing waits on it).
inline void prefetch_bytes(const uint8_t* begin, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(begin + line, 0, 3);
}

// Asks for blocks [b0, b1) of the row kPrefetchRows after row n (of rows up to end), if any.
template <Kind K>
inline void prefetch_row_ahead(const uint8_t* row, int64_t n, int64_t end, int64_t row_bytes,
                               int64_t b0, int64_t b1) {
  if (n + kPrefetchRows < end)
    prefetch_bytes(row + kPrefetchRows * row_bytes + b0 * block_bytes(K),
                   (b1 - b0) * block_bytes(K));
}

// Batch invariance (set_batch_invariant(true), speculative decoding): a decode row's result
// never depends on how many rows share its step. The float32 tiles sum every row alike anyway;
// it makes a lone row take them too, not the single-row kernels (another order), and 8-bit
// activations take every row count.
inline std::atomic<bool>& batch_invariant() {
  static std::atomic<bool> on{false};
  return on;
}

inline void set_batch_invariant(bool on) { batch_invariant().store(on); }

// Multiply-adds a thread should get at least, so small layers do not pay for a thread start.
constexpr int64_t kMinWorkPerThread = 1 << 15;

// A block as integer values and per-sub-block scales and offsets (unused for half kinds).
template <Kind K>
struct Unpacked {
  alignas(64) int8_t q[block_weights(K)];
  float scale[sub_blocks(K)];
  float offset[sub_blocks(K)];
};

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

inline float half_to_float(const uint8_t* p) {
  return c10::detail::fp16_ieee_to_fp32_value(read_u16(p));
}

inline float bf16_to_float(const uint8_t* p) {
  const uint32_t bits = static_cast<uint32_t>(read_u16(p)) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace pdserve_quantized
