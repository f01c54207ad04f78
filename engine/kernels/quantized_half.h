// Half-precision weights (f16, bf16) as the kernels read them: 2 bytes per weight, kept as the
// file stores them and widened to float32 (exactly) as they are used. A row of k weights counts
// as k / 32 "blocks" of 64 bytes, so every kind runs the same tiling.
#pragma once

#include "quantized_kinds.h"

namespace pdserve_quantized {

template <Kind K>
inline float half_weight(const uint8_t* p) {
  static_assert(is_half(K));
  return K == Kind::f16 ? half_to_float(p) : bf16_to_float(p);
}

}  // namespace pdserve_quantized
