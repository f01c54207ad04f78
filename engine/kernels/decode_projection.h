// The projections of a decoder layer as the fused decode layers hold them: each a row of parts
// (one weight matrix each, quantized GGUF blocks or dense float32) reading the same input.
#pragma once

#include "quantized_linear.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pdserve_decode {

// One matrix of a projection: GGUF blocks [N, K / block weights * block bytes] or a dense
// float32 weight_t [K, N].
struct Part {
  torch::Tensor weight;
  bool quantized = false;
  pdserve_quantized::Kind kind = pdserve_quantized::Kind::q8_0;
  int64_t n = 0, k = 0;

  // out [M, n] = x [M, k] . W^T
  void apply(const torch::Tensor& x, torch::Tensor& out) const {
    if (quantized)
      pdserve_quantized::quantized_matmul(x.data_ptr<float>(), x.size(0),
                                          weight.data_ptr<uint8_t>(), kind, n, k,
                                          out.data_ptr<float>());
    else if (x.size(0) > 1 && pdserve_quantized::batch_invariant().load())
      for (int64_t m = 0; m < x.size(0); ++m) {  // a GEMM's sums depend on its row count
        torch::Tensor row = out.narrow(0, m, 1);
        at::mm_out(row, x.narrow(0, m, 1), weight);
      }
    else
      at::mm_out(out, x, weight);
  }
};

inline Part make_part(torch::Tensor weight, const std::string& kind, int64_t n, int64_t k) {
  Part p{weight.contiguous(), kind != "dense", pdserve_quantized::Kind::q8_0, n, k};
  if (p.quantized) {
    p.kind = pdserve_quantized::parse_kind(kind);
    const int64_t block = pdserve_quantized::block_weights(p.kind);
    TORCH_CHECK(k % block == 0, "quantized projection: k = ", k, " is not a multiple of ", block);
    TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.size(0) == n &&
                    weight.size(1) == k / block * pdserve_quantized::block_bytes(p.kind),
                "quantized projection: blocks do not match [", n, ", ", k, "]");
  } else {
    TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.size(0) == k &&
                    weight.size(1) == n, "dense projection: float32 weight_t [", k, ", ", n, "]");
  }
  return p;
}

// A projection: one or more parts reading the same input, their outputs side by side (a GGUF
// keeps q, k and v in different formats where Q4_K_M gives v more bits), plus one bias.
struct Projection {
  std::vector<Part> parts;
  std::optional<torch::Tensor> bias;
  int64_t n = 0, k = 0;

  // Whether apply_rows computes it: every part quantized, the bias (if any) float32 [n].
  bool splits_by_rows() const {
    for (const Part& part : parts)
      if (!part.quantized) return false;
    return !bias || (bias->scalar_type() == torch::kFloat32 && bias->numel() == n);
  }

  // out [M, n] = x [M, k] . W^T (+ bias)
  void apply(const torch::Tensor& x, torch::Tensor& out) const {
    if (parts.size() == 1) {
      parts[0].apply(x, out);
    } else {
      int64_t column = 0;
      for (const Part& part : parts) {
        auto piece = torch::empty({x.size(0), part.n}, x.options());
        part.apply(x, piece);
        out.narrow(1, column, part.n).copy_(piece);
        column += part.n;
      }
    }
    if (bias) out.add_(*bias);
  }

  // Output features [begin, end) of out [M, n] (+ bias), on the calling thread: what apply
  // gives there, for a caller that splits the features over its own threads. Quantized parts
  // only; scratch is the thread's.
  void apply_rows(const float* x, int64_t M, int64_t begin, int64_t end, float* out,
                  pdserve_quantized::RowScratch& scratch) const {
    int64_t column = 0;
    for (const Part& part : parts) {
      const int64_t b = std::max(begin, column), e = std::min(end, column + part.n);
      if (b < e) {
        pdserve_quantized::prepare_matmul_rows(x, M, part.kind, k, scratch);
        pdserve_quantized::quantized_matmul_rows(x, M, part.weight.data_ptr<uint8_t>(),
                                                 part.kind, k, b - column, e - column,
                                                 out + column, n, scratch);
      }
      column += part.n;
    }
    if (!bias) return;
    const float* bias_p = bias->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = begin; i < end; ++i) out[m * n + i] += bias_p[i];
  }
};

using PartSpec = std::tuple<torch::Tensor, std::string, int64_t, int64_t>;
using ProjectionSpec = std::tuple<std::vector<PartSpec>, std::optional<torch::Tensor>>;

inline Projection make_projection(const ProjectionSpec& spec) {
  const auto& [part_specs, bias] = spec;
  TORCH_CHECK(!part_specs.empty(), "a projection has at least one part");
  Projection p{{}, bias, 0, std::get<3>(part_specs[0])};
  if (p.bias) p.bias = p.bias->contiguous();
  for (const auto& [weight, kind, n, k] : part_specs) {
    TORCH_CHECK(k == p.k, "the parts of a projection read the same input");
    p.parts.push_back(make_part(weight, kind, n, k));
    p.n += n;
  }
  return p;
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;

  bool splits_by_rows() const {
    return qkv.splits_by_rows() && o.splits_by_rows() && gate_up.splits_by_rows() &&
           down.splits_by_rows();
  }
};

}  // namespace pdserve_decode
