// The 256-weight GGUF "K" blocks (q4_k, q5_k, q6_k) unpacked into integer values q and per
// sub-block scales and offsets (quantized_kinds.h), byte for byte as ggml lays them out:
//
//   q4_k: fp16 d, fp16 dmin, 12 bytes of 6-bit sc_j and m_j (j < 8), 128 bytes qs
//         (sub-block j holds the low (j even) or high (j odd) nibbles of qs[32 (j / 2) ...])
//   q5_k: as q4_k, with 32 bytes qh before qs: bit j of qh[l] is the 5th bit of q in
//         sub-block j at position l
//   q6_k: 128 bytes ql, 64 bytes qh, 16 int8 sc_j (sub-blocks of 16), fp16 d; weight
//         128 h + 32 t + l takes 4 bits of ql[64 h + 32 (t % 2) + l] (high ones for t >= 2)
//         and bits 2t, 2t + 1 of qh[32 h + l]
#pragma once

#include "quantized_kinds.h"

namespace pdserve_quantized {

// q4_k / q5_k scales: sc_j (j < 8) and m_j, 6 bits each, packed into 12 bytes.
inline void kquant_scales(const uint8_t* packed, uint8_t sc[8], uint8_t m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = packed[j] & 0x3F;
    m[j] = packed[j + 4] & 0x3F;
    sc[j + 4] = (packed[j + 8] & 0x0F) | ((packed[j] >> 6) << 4);
    m[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
  }
}

template <Kind K>
inline void unpack_q45_k(const uint8_t* block, Unpacked<K>& u) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  uint8_t sc[8], m[8];
  kquant_scales(block + 4, sc, m);
  for (int j = 0; j < 8; ++j) {
    u.scale[j] = d * static_cast<float>(sc[j]);
    u.offset[j] = -(dmin * static_cast<float>(m[j]));
  }
  const uint8_t* qh = block + 16;
  const uint8_t* qs = block + (K == Kind::q5_k ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    const uint8_t* nibbles = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    int8_t* q = u.q + 32 * j;
    for (int l = 0; l < 32; ++l) {
      int value = (nibbles[l] >> shift) & 0x0F;
      if constexpr (K == Kind::q5_k) value |= ((qh[l] >> j) & 1) << 4;
      q[l] = static_cast<int8_t>(value);
    }
  }
}

inline void unpack_q6_k(const uint8_t* block, Unpacked<Kind::q6_k>& u) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_to_float(block + 208);
  for (int j = 0; j < 16; ++j) {
    u.scale[j] = d * static_cast<float>(sc[j]);
    u.offset[j] = 0.f;
  }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t) {
      const uint8_t* low = ql + 64 * h + 32 * (t % 2);
      const int low_shift = t < 2 ? 0 : 4, high_shift = 2 * t;
      int8_t* q = u.q + 128 * h + 32 * t;
      for (int l = 0; l < 32; ++l) {
        const int value = ((low[l] >> low_shift) & 0x0F) | (((qh[32 * h + l] >> high_shift) & 3) << 4);
        q[l] = static_cast<int8_t>(value - 32);
      }
    }
}

template <Kind K>
inline void unpack_kquant(const uint8_t* block, Unpacked<K>& u) {
  if constexpr (K == Kind::q6_k)
    unpack_q6_k(block, u);
  else
    unpack_q45_k<K>(block, u);
}

}  // namespace pdserve_quantized
