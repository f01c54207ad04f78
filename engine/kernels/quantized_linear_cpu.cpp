// Python bindings of the quantized linear kernels (quantized_linear.h).
#include "quantized_linear.h"

using namespace pdserve_quantized;

// x: [M, K] float32 with K = 32 * blocks per row; weight: [N, blocks * block bytes] uint8.
// Returns [M, N] float32.
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor weight, const std::string& kind) {
  const Shape s = check_blocks(weight, kind);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x: a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == s.blocks * kBlockWeights, "x has ", x.size(1), " features, the ",
              "weight blocks hold ", s.blocks * kBlockWeights);
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = torch::empty({M, s.N}, x.options());
  if (M == 0 || s.N == 0) return out;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (s.blocks == 0) return out.zero_();
  quantized_matmul(x.data_ptr<float>(), M, w, s.kind, s.N, s.blocks, out.data_ptr<float>());
  return out;
}

// weight: [N, blocks * block bytes] uint8; out: contiguous [N, 32 * blocks] float32, which
// receives the weights. Returns out.
torch::Tensor dequantize_into(torch::Tensor weight, const std::string& kind, torch::Tensor out) {
  const Shape s = check_blocks(weight, kind);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == s.N && out.size(1) == s.blocks * kBlockWeights,
              "out: a contiguous float32 [", s.N, ", ", s.blocks * kBlockWeights, "] tensor");
  if (out.numel() == 0) return out;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (s.kind == Kind::q8_0)
    dequantize<Kind::q8_0>(w, s.N, s.blocks, out.data_ptr<float>());
  else
    dequantize<Kind::q4_1>(w, s.N, s.blocks, out.data_ptr<float>());
  return out;
}

// weight: [N, blocks * block bytes] uint8. Returns the weights as [N, 32 * blocks] float32.
torch::Tensor dequantize_blocks(torch::Tensor weight, const std::string& kind) {
  const Shape s = check_blocks(weight, kind);
  return dequantize_into(weight, kind,
                         torch::empty({s.N, s.blocks * kBlockWeights}, torch::kFloat32));
}

void set_isa(const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "scalar", "set_isa: 'auto' or 'scalar', not '", isa, "'");
  force_scalar.store(isa == "scalar");
}

std::string isa() { return use_avx2() ? "avx2" : "scalar"; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear,
        "x @ dequantize(weight).T for GGUF Q8_0/Q4_1 weight blocks (float32, CPU)");
  m.def("dequantize", &dequantize_blocks, "GGUF Q8_0/Q4_1 weight blocks as float32 (CPU)");
  m.def("dequantize_into", &dequantize_into, "dequantize, writing into a given float32 tensor");
  m.def("set_isa", &set_isa, "'scalar' forces the portable path; 'auto' picks by CPU features");
  m.def("isa", &isa, "The path quantized_linear runs now: 'avx2' or 'scalar'");
  m.def("avx2_supported", &cpu_has_avx2, "Whether this CPU has AVX2, FMA and F16C");
}
