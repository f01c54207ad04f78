// The 32-weight GGUF blocks (q8_0, q4_0, q4_1, q5_0, q5_1) unpacked into integer values q and
// the block's scale and offset (quantized_kinds.h), byte for byte as ggml lays them out:
//
//   q8_0: fp16 d, 32 int8 q
//   q4_0: fp16 d, 16 bytes qs                    (q_j = qs[j] & 0x0F, q_j+16 = qs[j] >> 4)
//   q4_1: fp16 d, fp16 m, 16 bytes qs
//   q5_0: fp16 d, uint32 qh, 16 bytes qs         (bit j of qh is the 5th bit of q_j)
//   q5_1: fp16 d, fp16 m, uint32 qh, 16 bytes qs
#pragma once

#include "quantized_kinds.h"

namespace pdserve_quantized {

// q_j from the nibbles qs (weight j < 16 low, j + 16 high), the 5th bits qh, less bias.
inline void unpack_nibbles(const uint8_t* qs, uint32_t qh, int bias, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - bias);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
  }
}

inline uint32_t read_u32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

template <Kind K>
inline void unpack_legacy(const uint8_t* block, Unpacked<K>& u) {
  u.scale[0] = half_to_float(block);
  u.offset[0] = 0.f;
  if constexpr (K == Kind::q8_0) {
    std::memcpy(u.q, block + 2, 32);
  } else if constexpr (K == Kind::q4_0) {
    unpack_nibbles(block + 2, 0, 8, u.q);
  } else if constexpr (K == Kind::q4_1) {
    u.offset[0] = half_to_float(block + 2);
    unpack_nibbles(block + 4, 0, 0, u.q);
  } else if constexpr (K == Kind::q5_0) {
    unpack_nibbles(block + 6, read_u32(block + 2), 16, u.q);
  } else {
    static_assert(K == Kind::q5_1);
    u.offset[0] = half_to_float(block + 2);
    unpack_nibbles(block + 8, read_u32(block + 4), 0, u.q);
  }
}

}  // namespace pdserve_quantized
