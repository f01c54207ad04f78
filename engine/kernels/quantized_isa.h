// Which instruction set the quantized kernels run: AVX2 or the portable scalar code chosen from
// the CPU's features, AVX-512 only once set_isa("avx512") asks for it (after avx512_probe() ran
// safely, in a child process: cpuid may list instructions a virtual machine faults on).
#pragma once

#include "quantized_vectors.h"

namespace pdserve_quantized {

enum class Isa { scalar, avx2, avx512 };

inline bool cpu_has_avx2() {
#if PDSERVE_HAS_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// What cpuid lists; whether the instructions really run is avx512_probe()'s question.
inline bool cpu_lists_avx512() {
#if PDSERVE_HAS_X86
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

inline bool cpu_lists_avx512_vnni() {
#if PDSERVE_HAS_X86
  return cpu_lists_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Runs AVX-512 F/BW/VL instructions, and a VNNI one where cpuid lists it (the 8-bit activation
// path runs VNNI wherever AVX-512 was chosen), and checks what they give.
inline bool avx512_probe() {
#if PDSERVE_HAS_X86
  return cpu_lists_avx512() && run_avx512_probe() &&
         (!cpu_lists_avx512_vnni() || run_avx512_vnni_probe());
#else
  return false;
#endif
}

inline Isa auto_isa() { return cpu_has_avx2() ? Isa::avx2 : Isa::scalar; }

inline std::atomic<Isa>& selected_isa() {
  static std::atomic<Isa> isa{auto_isa()};
  return isa;
}

inline Isa current_isa() { return selected_isa().load(std::memory_order_relaxed); }

// The path 8-bit activations take (quantized_int8.h), chosen with the ISA: VNNI's dpbusd where
// AVX-512 was chosen and cpuid lists VNNI (avx512_probe ran it), else AVX2's maddubs, else scalar.
enum class Int8Path { scalar, avx2, vnni };

inline Int8Path int8_path_for(Isa isa) {
  if (isa == Isa::avx512 && cpu_lists_avx512_vnni()) return Int8Path::vnni;
  return isa == Isa::scalar ? Int8Path::scalar : Int8Path::avx2;
}

inline std::atomic<Int8Path>& selected_int8_path() {
  static std::atomic<Int8Path> path{int8_path_for(auto_isa())};
  return path;
}

inline Int8Path current_int8_path() {
  return selected_int8_path().load(std::memory_order_relaxed);
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar";
}

inline void set_isa(const std::string& name) {
  Isa isa = auto_isa();
  if (name == "scalar") {
    isa = Isa::scalar;
  } else if (name == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "set_isa: this CPU lacks AVX2, FMA or F16C");
    isa = Isa::avx2;
  } else if (name == "avx512") {
    TORCH_CHECK(cpu_lists_avx512(), "set_isa: this CPU lacks AVX-512 F, BW or VL");
    isa = Isa::avx512;
  } else {
    TORCH_CHECK(name == "auto", "set_isa: 'auto', 'avx512', 'avx2' or 'scalar', not '", name, "'");
  }
  selected_isa().store(isa);
  selected_int8_path().store(int8_path_for(isa));
}

}  // namespace pdserve_quantized
