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
// rest as plain loops in float32 in the operation order of the Python path (llama.py)
// (decode_layer_math.h). Where every projection is quantized the whole step runs in one
// parallel region (decode_layers_parallel.h); dense weights take the operations one by one.
#include "decode_layers_parallel.h"

#include <string>
#include <vector>

namespace {

using namespace pdserve_decode;

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
    splits_by_rows_ = splits_by_rows_ && layers_.back().splits_by_rows();
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [M, E] float32, updated in place through every layer and returned. positions,
  // slots: [M]; tables [M, max_blocks], lens [M] as the paged attention takes them;
  // kv_caches[i]: layer i's [2, num_blocks, block_size, KVH, D] cache (float32, float16 or
  // bfloat16, the same for every layer).
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
    const int64_t* slot_p = slots.data_ptr<int64_t>();
    std::vector<CacheView> caches;
    for (const torch::Tensor& cache : kv_caches) {
      TORCH_CHECK(cache.is_contiguous() && cache.size(3) == KVH_ && cache.size(4) == D_ &&
                      cache.scalar_type() == kv_caches[0].scalar_type(), "KV cache layout");
      const int64_t cache_rows = cache.size(1) * cache.size(2);
      for (int64_t m = 0; m < M; ++m)
        TORCH_CHECK(slot_p[m] >= 0 && slot_p[m] < cache_rows, "slot ", slot_p[m],
                    " outside the cache");
      char* keys = static_cast<char*>(cache.data_ptr());
      caches.push_back({keys, keys + cache_rows * KVH_ * D_ * cache.element_size(), cache.size(2),
                        cache.scalar_type()});
    }
    const StepShape shape{M, E, H_, KVH_, D_, layers_[0].gate_up.n / 2, eps_, scale_};
    const StepInputs in{hidden.data_ptr<float>(), positions.data_ptr<int64_t>(), slot_p,
                        tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                        cos_.data_ptr<float>(), sin_.data_ptr<float>(), std::move(caches)};
    if (splits_by_rows_)
      forward_region(shape, in);
    else
      forward_op_by_op(shape, in);
    return hidden;
  }

 private:
  void forward_region(const StepShape& s, const StepInputs& in) const {
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    auto qkv = torch::empty({s.M, (s.H + 2 * s.KVH) * s.D}, opts);
    auto attn = torch::empty({s.M, s.H * s.D}, opts), delta = torch::empty({s.M, s.E}, opts);
    auto gate_up = torch::empty({s.M, 2 * s.inter}, opts);
    auto act = torch::empty({s.M, s.inter}, opts);
    const StepBuffers buf{qkv.data_ptr<float>(), attn.data_ptr<float>(),
                          gate_up.data_ptr<float>(), act.data_ptr<float>(),
                          delta.data_ptr<float>()};
    forward_in_one_region(layers_, s, in, buf, at::get_num_threads());
  }

  // The same step an operation at a time, each projection splitting its own work.
  void forward_op_by_op(const StepShape& s, const StepInputs& in) const {
    const int64_t M = s.M, E = s.E, q_width = H_ * D_, kv_width = KVH_ * D_, inter = s.inter;
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    auto normed = torch::empty({M, E}, opts), delta = torch::empty({M, E}, opts);
    auto qkv = torch::empty({M, q_width + 2 * kv_width}, opts);
    auto q = torch::empty({M, q_width}, opts), attn = torch::empty({M, q_width}, opts);
    auto gate_up = torch::empty({M, 2 * inter}, opts), act = torch::empty({M, inter}, opts);
    float* h = in.hidden;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const CacheView& cache = in.caches[i];
      rms_norm(h, layer.input_norm.data_ptr<float>(), M, E, eps_, normed.data_ptr<float>());
      layer.qkv.apply(normed, qkv);
      float* qkv_p = qkv.data_ptr<float>();
      float* q_p = q.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) {
        float* row = qkv_p + m * qkv.size(1);
        rotate(row, H_ + KVH_, D_, in.cos + in.positions[m] * D_, in.sin + in.positions[m] * D_);
        std::copy(row, row + q_width, q_p + m * q_width);
        cache.typed([&](auto keys, auto values) {
          pdserve_attention::store_row(row + q_width, keys + in.slots[m] * kv_width, kv_width);
          pdserve_attention::store_row(row + q_width + kv_width, values + in.slots[m] * kv_width,
                                       kv_width);
        });
      }
      cache.typed([&](auto keys, auto values) {
        pdserve_attention::paged_decode(q_p, M, H_, D_, keys, values, cache.block_size, KVH_,
                                        in.tables, in.max_blocks, in.lens, scale_,
                                        attn.data_ptr<float>());
      });
      layer.o.apply(attn, delta);
      add_into(h, delta.data_ptr<float>(), M * E);

      rms_norm(h, layer.post_norm.data_ptr<float>(), M, E, eps_, normed.data_ptr<float>());
      layer.gate_up.apply(normed, gate_up);
      at::silu_out(act, gate_up.narrow(1, 0, inter));  // torch's vectorized silu
      act.mul_(gate_up.narrow(1, inter, inter));
      layer.down.apply(act, delta);
      add_into(h, delta.data_ptr<float>(), M * E);
    }
  }

  int64_t H_, KVH_, D_;
  float eps_, scale_;
  torch::Tensor cos_, sin_;
  std::vector<Layer> layers_;
  bool splits_by_rows_ = true;  // every layer can run in one parallel region
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
