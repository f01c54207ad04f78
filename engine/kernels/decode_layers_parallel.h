// A decode step's decoder layers in one OpenMP parallel region: the threads are woken once per
// step, not once per operation, and meet at barriers between dependent operations instead.
//
// Per layer, each of the T threads
//   1. computes x = rms_norm(h) itself (every thread the same x, in its own buffer: cheaper than
//      a barrier) and its share of the qkv features;                               -- barrier
//   2. takes its share of the (sequence, kv head) items: rotary on that kv head's query heads
//      and key, the key and value into the paged cache, and the head group's attention (by
//      single query heads where the groups do not split evenly; then, and with several
//      sequences, a barrier separates the cache writes from the attention);
//                                                                                   -- barrier
//   3. its share of the o features, added into h;                                  -- barrier
//   4. x = rms_norm(h) itself, its share j in [a, b) of the gate and up features (gate j and
//      up j on the same thread) and act[j] = silu(gate j) * up j;                  -- barrier
//   5. its share of the down features, added into h;                               -- barrier
// Each output feature is computed by one thread with the kernels and operation order of the
// op-by-op path, so the results are the same as there.
#pragma once

#include "decode_layer_math.h"
#include "decode_projection.h"
#include "paged_attention.h"

#include <omp.h>

#include <vector>

namespace pdserve_decode {

// Layer i's paged cache: keys and values [num_blocks * BS, KVH, D] each, of `type` (float32,
// float16 or bfloat16).
struct CacheView {
  void* keys;
  void* values;
  int64_t block_size;
  at::ScalarType type;

  // fn(keys, values) with the pointers of the cache's element type.
  template <typename Fn>
  void typed(Fn&& fn) const {
    pdserve_attention::with_cache_type(type, [&](auto zero) {
      using T = decltype(zero);
      fn(static_cast<T*>(keys), static_cast<T*>(values));
    });
  }
};

// The shapes of the model and the step's inputs, as DecodeLayers::forward checked them.
struct StepShape {
  int64_t M, E, H, KVH, D, inter;
  float eps, scale;
};

struct StepInputs {
  float* hidden;                   // [M, E], updated in place
  const int64_t* positions;        // [M]
  const int64_t* slots;            // [M]
  const int64_t* tables;           // [M, max_blocks]
  int64_t max_blocks;
  const int64_t* lens;             // [M]
  const float* cos;                // [positions, D]
  const float* sin;
  std::vector<CacheView> caches;   // one per layer
};

// The step's shared buffers: qkv [M, (H + 2 KVH) D], attn [M, H D], gate_up [M, 2 inter],
// act [M, inter], delta [M, E].
struct StepBuffers {
  float* qkv;
  float* attn;
  float* gate_up;
  float* act;
  float* delta;
};

// Rotary, cache write and attention of kv head h of sequence b (step 2).
inline void rotate_and_store(const StepShape& s, const StepInputs& in, const CacheView& cache,
                             float* qkv, int64_t b, int64_t h) {
  const int64_t G = s.H / s.KVH, D = s.D, kv_width = s.KVH * D;
  float* row = qkv + b * (s.H + 2 * s.KVH) * D;
  const float* c = in.cos + in.positions[b] * D;
  const float* sn = in.sin + in.positions[b] * D;
  float* key = row + s.H * D + h * D;
  const float* value = key + kv_width;
  rotate(row + h * G * D, G, D, c, sn);
  rotate(key, 1, D, c, sn);
  const int64_t at = in.slots[b] * kv_width + h * D;
  cache.typed([&](auto keys, auto values) {
    pdserve_attention::store_row(key, keys + at, D);
    pdserve_attention::store_row(value, values + at, D);
  });
}

struct AttentionScratch {
  std::vector<float> scores, top, total;
};

// Attention of `heads` query heads from `first` on, all of one kv head, of sequence b.
inline void attend(const StepShape& s, const StepInputs& in, const CacheView& cache,
                   const float* qkv, float* attn, int64_t b, int64_t first, int64_t heads,
                   AttentionScratch& a) {
  const int64_t G = s.H / s.KVH, D = s.D;
  const float* q = qkv + b * (s.H + 2 * s.KVH) * D + first * D;
  cache.typed([&](auto keys, auto values) {
    pdserve_attention::group_attention(q, heads, D, keys, values, s.KVH, first / G,
                                       in.tables + b * in.max_blocks, in.lens[b],
                                       cache.block_size, s.scale, attn + (b * s.H + first) * D,
                                       a.scores, a.top, a.total);
  });
}

// Step 2 on thread t: the (sequence, kv head) items' rotary and cache writes, then attention by
// kv head group, or by single query head where the groups do not split evenly over the threads
// (3 kv heads on 2 threads; each query head's scores are the same sums either way).
inline void attention_on_thread(const StepShape& s, const StepInputs& in, const CacheView& cache,
                                const StepBuffers& buf, int t, int T, AttentionScratch& a) {
  const int64_t G = s.H / s.KVH, items = s.M * s.KVH;
  const bool by_query_head = items % T != 0;
  auto [i0, i1] = share(items, t, T);
  for (int64_t i = i0; i < i1; ++i) rotate_and_store(s, in, cache, buf.qkv, i / s.KVH, i % s.KVH);
  if (s.M > 1 || by_query_head) {
#pragma omp barrier
  }
  if (by_query_head) {
    auto [h0, h1] = share(s.M * s.H, t, T);
    for (int64_t i = h0; i < h1; ++i)
      attend(s, in, cache, buf.qkv, buf.attn, i / s.H, i % s.H, 1, a);
  } else {
    for (int64_t i = i0; i < i1; ++i)
      attend(s, in, cache, buf.qkv, buf.attn, i / s.KVH, i % s.KVH * G, G, a);
  }
}

// Adds delta's features [begin, end) into h, for every row.
inline void add_features(float* h, const float* delta, int64_t M, int64_t E, int64_t begin,
                         int64_t end) {
  for (int64_t m = 0; m < M; ++m) add_into(h + m * E + begin, delta + m * E + begin, end - begin);
}

// One layer on thread t of T (the numbered steps above).
inline void layer_on_thread(const Layer& layer, const StepShape& s, const StepInputs& in,
                            const CacheView& cache, const StepBuffers& buf, int t, int T,
                            std::vector<float>& x, pdserve_quantized::RowScratch& rows,
                            AttentionScratch& scratch) {
  const int64_t M = s.M, E = s.E, inter = s.inter;
  float* h = in.hidden;
  rms_norm(h, layer.input_norm.data_ptr<float>(), M, E, s.eps, x.data());
  auto [q0, q1] = share(layer.qkv.n, t, T);
  layer.qkv.apply_rows(x.data(), M, q0, q1, buf.qkv, rows);
#pragma omp barrier
  attention_on_thread(s, in, cache, buf, t, T, scratch);
#pragma omp barrier
  auto [e0, e1] = share(E, t, T);
  layer.o.apply_rows(buf.attn, M, e0, e1, buf.delta, rows);
  add_features(h, buf.delta, M, E, e0, e1);
#pragma omp barrier
  rms_norm(h, layer.post_norm.data_ptr<float>(), M, E, s.eps, x.data());
  auto [j0, j1] = share(inter, t, T);
  layer.gate_up.apply_rows(x.data(), M, j0, j1, buf.gate_up, rows);
  layer.gate_up.apply_rows(x.data(), M, inter + j0, inter + j1, buf.gate_up, rows);
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = buf.gate_up + m * 2 * inter;
    silu_mul(gate + j0, gate + inter + j0, j1 - j0, buf.act + m * inter + j0);
  }
#pragma omp barrier
  layer.down.apply_rows(buf.act, M, e0, e1, buf.delta, rows);
  add_features(h, buf.delta, M, E, e0, e1);
#pragma omp barrier
}

// Every layer of the step in one parallel region on `threads` threads.
inline void forward_in_one_region(const std::vector<Layer>& layers, const StepShape& s,
                                  const StepInputs& in, const StepBuffers& buf, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    std::vector<float> x(s.M * s.E);
    pdserve_quantized::RowScratch rows;
    const int64_t G = s.H / s.KVH;
    AttentionScratch scratch{{}, std::vector<float>(G), std::vector<float>(G)};
    for (size_t i = 0; i < layers.size(); ++i)
      layer_on_thread(layers[i], s, in, in.caches[i], buf, t, T, x, rows, scratch);
  }
}

}  // namespace pdserve_decode
