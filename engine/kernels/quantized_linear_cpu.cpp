// Python bindings of the quantized linear kernels (quantized_linear.h).
#include "quantized_linear.h"

using namespace pdserve_quantized;

struct Shape {
  Kind kind;
  int64_t N, k;  // k: weights per row, whole blocks
};

Shape check_blocks(const torch::Tensor& weight, const std::string& kind_name) {
  const Kind kind = parse_kind(kind_name);
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.dim() == 2 && weight.is_contiguous(),
              "weight blocks: a contiguous 2-D uint8 tensor");
  TORCH_CHECK(weight.size(1) % block_bytes(kind) == 0, "weight rows of ", weight.size(1),
              " bytes are not whole ", kind_name, " blocks");
  return {kind, weight.size(0), weight.size(1) / block_bytes(kind) * block_weights(kind)};
}

// x: [M, k] float32, k a whole number of blocks per row; weight: [N, k / block weights * block
// bytes] uint8. Returns [M, N] float32.
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor weight, const std::string& kind) {
  const Shape s = check_blocks(weight, kind);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x: a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == s.k, "x has ", x.size(1), " features, the weight blocks hold ", s.k);
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = torch::empty({M, s.N}, x.options());
  if (M == 0 || s.N == 0) return out;
  if (s.k == 0) return out.zero_();
  quantized_matmul(x.data_ptr<float>(), M, weight.data_ptr<uint8_t>(), s.kind, s.N, s.k,
                   out.data_ptr<float>());
  return out;
}

// weight: [N, k / block weights * block bytes] uint8; out: contiguous [N, k] float32, which
// receives the weights. Returns out.
torch::Tensor dequantize_into(torch::Tensor weight, const std::string& kind, torch::Tensor out) {
  const Shape s = check_blocks(weight, kind);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == s.N && out.size(1) == s.k,
              "out: a contiguous float32 [", s.N, ", ", s.k, "] tensor");
  if (out.numel() == 0) return out;
  dequantize_matrix(weight.data_ptr<uint8_t>(), s.kind, s.N, s.k, out.data_ptr<float>());
  return out;
}

// weight: [N, k / block weights * block bytes] uint8. Returns the weights as [N, k] float32.
torch::Tensor dequantize_blocks(torch::Tensor weight, const std::string& kind) {
  const Shape s = check_blocks(weight, kind);
  return dequantize_into(weight, kind, torch::empty({s.N, s.k}, torch::kFloat32));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear,
        "x @ dequantize(weight).T for GGUF weight blocks (float32, CPU)");
  m.def("dequantize", &dequantize_blocks, "GGUF weight blocks as float32 (CPU)");
  m.def("dequantize_into", &dequantize_into, "dequantize, writing into a given float32 tensor");
  bind_isa_functions(m);
}
