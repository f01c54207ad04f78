// Every decoder layer of a decode step in one call: no Python, no tensor allocated per layer.
//
// A decode step carries one token per sequence (M rows, a few dozen at most). Run op by op from
// Python, each of a layer's ~35 small operations pays the interpreter and torch's dispatcher,
// which for a 135M model costs as much as the math. Here a layer is
//
//   x = rms_norm(h) -> qkv = x W_qkv (+ b) -> rotary on q, k -> k, v into the paged cache
//   -> paged decode attention -> h += attn W_o -> x = rms_norm(h) -> gu = x W_gate_up
//   -> a = silu(gate) * up -> h += a W_down
//
// with the projections on the quantized kernels (quantized_linear.h) or on float32 GEMM for
// dense weights, the attention on paged_attention.h, SwiGLU on torch's vectorized silu, and the
// rest as plain loops in float32 in the operation order of the Python path (llama.py).
#include "paged_attention.h"
#include "quantized_linear.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace {

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
    else
      at::mm_out(out, x, weight);
  }
};

Part make_part(torch::Tensor weight, const std::string& kind, int64_t n, int64_t k) {
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
};

using PartSpec = std::tuple<torch::Tensor, std::string, int64_t, int64_t>;
using ProjectionSpec = std::tuple<std::vector<PartSpec>, std::optional<torch::Tensor>>;

Projection make_projection(const ProjectionSpec& spec) {
  const auto& [part_specs, bias] = spec;
  TORCH_CHECK(!part_specs.empty(), "a projection has at least one part");
  Projection p{{}, bias, 0, std::get<3>(part_specs[0])};
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
};

// out[m] = x[m] / rms(x[m]) * weight, as torch's rms_norm computes it in float32.
void rms_norm(const float* x, const float* weight, int64_t M, int64_t E, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * E;
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += row[e] * row[e];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e) out[m * E + e] = row[e] * inv * weight[e];
  }
}

// Rotate-half RoPE on `heads` heads of D values starting at v, with this token's cos, sin rows.
void rotate(float* v, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h, v += D)
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = v[d], x2 = v[d + half];
      v[d] = x1 * cos[d] - x2 * sin[d];
      v[d + half] = x2 * cos[d + half] + x1 * sin[d + half];
    }
}

class DecodeLayers {
 public:
  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
               torch::Tensor cos, torch::Tensor sin)
      : H_(heads), KVH_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)), cos_(cos.contiguous()), sin_(sin.contiguous()) {
    TORCH_CHECK(H_ % KVH_ == 0 && D_ % 2 == 0, "heads must group over kv heads; even head_dim");
    TORCH_CHECK(cos_.scalar_type() == torch::kFloat32 && cos_.size(1) == D_,
                "rotary tables: float32 [positions, head_dim]");
  }

  // projections: qkv, o, gate_up, down, each ([(weight, kind, n, k), ...], bias)
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm,
                 std::vector<ProjectionSpec> projections) {
    TORCH_CHECK(projections.size() == 4, "a layer has 4 projections: qkv, o, gate_up, down");
    std::vector<Projection> p;
    for (const auto& spec : projections) p.push_back(make_projection(spec));
    const int64_t E = input_norm.size(0);
    TORCH_CHECK(p[0].k == E && p[0].n == (H_ + 2 * KVH_) * D_ && p[1].k == H_ * D_ &&
                    p[1].n == E && p[2].k == E && p[2].n % 2 == 0 && p[3].k == p[2].n / 2 &&
                    p[3].n == E, "layer projections do not chain");
    layers_.push_back({input_norm.contiguous(), post_norm.contiguous(), p[0], p[1], p[2], p[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [M, E] float32, updated in place through every layer and returned. positions,
  // slots: [M]; tables [M, max_blocks], lens [M] as the paged attention takes them;
  // kv_caches[i]: layer i's [2, num_blocks, block_size, KVH, D] float32 cache.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor slots,
                        torch::Tensor tables, torch::Tensor lens,
                        const std::vector<torch::Tensor>& kv_caches) {
    TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.is_contiguous() &&
                    hidden.dim() == 2, "hidden: contiguous float32 [M, E]");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(positions.is_contiguous() && slots.is_contiguous() && tables.is_contiguous() &&
                    lens.is_contiguous(), "contiguous int64 step metadata");
    const int64_t M = hidden.size(0), E = hidden.size(1);
    if (M == 0) return hidden;
    const int64_t q_width = H_ * D_, kv_width = KVH_ * D_;
    const int64_t inter = layers_[0].gate_up.n / 2;
    auto opts = hidden.options();
    auto normed = torch::empty({M, E}, opts), delta = torch::empty({M, E}, opts);
    auto qkv = torch::empty({M, q_width + 2 * kv_width}, opts);
    auto q = torch::empty({M, q_width}, opts), attn = torch::empty({M, q_width}, opts);
    auto gate_up = torch::empty({M, 2 * inter}, opts), act = torch::empty({M, inter}, opts);
    float* h = hidden.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const torch::Tensor& cache = kv_caches[i];
      TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == torch::kFloat32 &&
                      cache.size(3) == KVH_ && cache.size(4) == D_, "KV cache layout");
      const int64_t BS = cache.size(2), cache_rows = cache.size(1) * BS;
      float* keys = cache.data_ptr<float>();
      float* values = keys + cache_rows * kv_width;

      rms_norm(h, layer.input_norm.data_ptr<float>(), M, E, eps_, normed.data_ptr<float>());
      layer.qkv.apply(normed, qkv);
      float* qkv_p = qkv.data_ptr<float>();
      float* q_p = q.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) {
        float* row = qkv_p + m * qkv.size(1);
        const float* c = cos_.data_ptr<float>() + pos[m] * D_;
        const float* s = sin_.data_ptr<float>() + pos[m] * D_;
        rotate(row, H_ + KVH_, D_, c, s);
        TORCH_CHECK(slot[m] >= 0 && slot[m] < cache_rows, "slot ", slot[m], " outside the cache");
        std::copy(row, row + q_width, q_p + m * q_width);
        std::copy(row + q_width, row + q_width + kv_width, keys + slot[m] * kv_width);
        std::copy(row + q_width + kv_width, row + q_width + 2 * kv_width,
                  values + slot[m] * kv_width);
      }
      pdserve_attention::paged_decode(q_p, M, H_, D_, keys, values, BS, KVH_,
                                      tables.data_ptr<int64_t>(), tables.size(1),
                                      lens.data_ptr<int64_t>(), scale_, attn.data_ptr<float>());
      layer.o.apply(attn, delta);
      add_into(h, delta.data_ptr<float>(), M * E);

      rms_norm(h, layer.post_norm.data_ptr<float>(), M, E, eps_, normed.data_ptr<float>());
      layer.gate_up.apply(normed, gate_up);
      at::silu_out(act, gate_up.narrow(1, 0, inter));  // torch's vectorized silu
      act.mul_(gate_up.narrow(1, inter, inter));
      layer.down.apply(act, delta);
      add_into(h, delta.data_ptr<float>(), M * E);
    }
    return hidden;
  }

 private:
  static void add_into(float* h, const float* delta, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) h[i] += delta[i];
  }

  int64_t H_, KVH_, D_;
  float eps_, scale_;
  torch::Tensor cos_, sin_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward,
           "All decoder layers of a decode step, hidden updated in place (float32, CPU)");
  pdserve_quantized::bind_isa_functions(m);
}
