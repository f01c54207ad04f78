// Python bindings of the CPU decode kernels: paged decode attention (paged_attention.h) and the
// sampled tokens' log probabilities (token_logprobs.h).
#include "paged_attention.h"
#include "token_logprobs.h"

using namespace pdserve_attention;

// q: [B, H, D] float32; kv_cache: [2, num_blocks, block_size, KVH, D] float32, float16 or
// bfloat16 (contiguous);
// block_tables: [B, max_blocks] int64; context_lens: [B] int64. Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 queries");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() &&
              context_lens.is_contiguous(), "paged_decode_attention: contiguous inputs only");
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  with_cache_type(kv_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* kp = static_cast<const T*>(kv_cache.data_ptr());
    const T* vp = kp + num_blocks * BS * KVH * D;
    paged_decode(q.data_ptr<float>(), B, H, D, kp, vp, BS, KVH, block_tables.data_ptr<int64_t>(),
                 max_blocks, context_lens.data_ptr<int64_t>(), static_cast<float>(scale),
                 out.data_ptr<float>());
  });
  return out;
}

// rows [n, D] float32 written into out [n, D] (float32, float16 or bfloat16) as the kernels
// write a key or value row into the cache (store_row).
void store_rows(torch::Tensor rows, torch::Tensor out) {
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() &&
                  out.is_contiguous() && rows.sizes() == out.sizes() && rows.dim() == 2,
              "store_rows: contiguous float32 rows and an output of their shape");
  with_cache_type(out.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = rows.size(0), D = rows.size(1);
    for (int64_t i = 0; i < n; ++i)
      store_row(rows.data_ptr<float>() + i * D, static_cast<T*>(out.data_ptr()) + i * D, D);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_rows", &store_rows, "float32 rows rounded into out as the cache stores them");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (float32, float16 or bfloat16 pages; CPU)");
  m.def("token_logprobs", &pdserve_logprobs::token_logprobs,
        "Each row's chosen token's log probability and its k best, one pass a row (CPU)");
}
