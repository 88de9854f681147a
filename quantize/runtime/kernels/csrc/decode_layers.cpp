// The fused decode step: every decoder layer of a step of single-token decodes in one OpenMP region of torch's
// threads (see run_layers).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "ops.h"

namespace qpack {
namespace {

struct Layer {
  const float* input_norm;
  float input_eps;
  Proj qkv, o;
  const float* post_norm;
  float post_eps;
  Proj gate_up, down;
  void* k_cache;
  void* v_cache;
};

// All decoder layers of a decode step (one new token per sequence), in one OpenMP region: the threads split
// each linear's output rows and the attention heads, and meet at a barrier between dependent stages, instead
// of forking and joining ~8 times per layer from Python.
template <typename T>
void run_layers(float* h, int64_t D, int64_t Hd, const float* cos, const float* sin, const std::vector<Layer>& layers,
                const int64_t* new_slots, const int64_t* ctx_slots, const int64_t* starts, const int64_t* lengths,
                int64_t L, int64_t H, int64_t KVH, int64_t d, float scale, float* qkv, float* att,
                float* act, float* mid, int64_t I) {
  const int64_t Nq = (H + 2 * KVH) * d, group = H / KVH, slot_stride = KVH * d;
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    std::vector<float> scores(std::max<int64_t>(L, 1)), row_scale(D), xn(D * Hd);
    const int64_t widest = std::max({Hd, H * d, I});
    std::vector<int16_t> q(D * widest), q4(D * widest);
    std::vector<int32_t> group_sum(D * (widest / 32 + 1));
    auto input = [&](const float* x, int64_t K) {
      return Act{x, D, K, q.data(), row_scale.data(), q4.data(), group_sum.data()};
    };
    auto norm = [&](const float* weight, float eps) {
      for (int64_t m = 0; m < D; ++m) norm_row(h + m * Hd, weight, Hd, eps, xn.data() + m * Hd);
    };
    for (size_t index = 0; index < layers.size(); ++index) {
      const Layer& ly = layers[index];
      T* kc = static_cast<T*>(ly.k_cache);
      T* vc = static_cast<T*>(ly.v_cache);
      const auto qkv_rows = share(ly.qkv, 0, Nq, d, tid, nth), o_rows = share(ly.o, 0, Hd, 1, tid, nth);
      const auto mlp_rows = share(ly.gate_up, 0, I, 1, tid, nth), down_rows = share(ly.down, 0, Hd, 1, tid, nth);
      norm(ly.input_norm, ly.input_eps);
      {
        Act a = input(xn.data(), Hd);
        proj_range(ly.qkv, a, qkv, Nq, qkv_rows.first, qkv_rows.second);
      }
      for (int64_t head = qkv_rows.first / d; head < qkv_rows.second / d; ++head) {
        for (int64_t m = 0; m < D; ++m) {
          float* x = qkv + m * Nq + head * d;
          if (head < H + KVH) rope(x, cos + m * d, sin + m * d, d);
          if (head >= H) {
            const bool is_key = head < H + KVH;
            T* dst = (is_key ? kc : vc) + new_slots[m] * slot_stride + (head - H - (is_key ? 0 : KVH)) * d;
            for (int64_t e = 0; e < d; ++e) store(dst + e, x[e]);
          }
        }
      }
      prefetch_rows(ly.o, o_rows.first);
#pragma omp barrier
      for (int64_t task = tid; task < D * H; task += nth) {
        const int64_t m = task / H, head = task % H, first = starts[m];
        attend(qkv + m * Nq + head * d, kc, vc, ctx_slots + m * L + first, lengths[m] - first, slot_stride,
               (head / group) * d, d, scale, scores.data(), att + m * H * d + head * d);
      }
#pragma omp barrier
      {
        Act a = input(att, H * d);
        proj_range(ly.o, a, h, Hd, o_rows.first, o_rows.second, true);
      }
      prefetch_rows(ly.gate_up, mlp_rows.first);
      prefetch_rows(ly.gate_up, I + mlp_rows.first);
#pragma omp barrier
      norm(ly.post_norm, ly.post_eps);
      {
        const int64_t n0 = mlp_rows.first, n1 = mlp_rows.second;
        Act a = input(xn.data(), Hd);
        proj_range(ly.gate_up, a, act, 2 * I, n0, n1);
        proj_range(ly.gate_up, a, act, 2 * I, I + n0, I + n1);
        for (int64_t m = 0; m < D; ++m) {
          float* row = act + m * 2 * I;
          for (int64_t n = n0; n < n1; ++n) mid[m * I + n] = row[n] / (1.0f + std::exp(-row[n])) * row[I + n];
        }
      }
      prefetch_rows(ly.down, down_rows.first);
#pragma omp barrier
      {
        Act a = input(mid, I);
        proj_range(ly.down, a, h, Hd, down_rows.first, down_rows.second, true);
      }
      if (index + 1 < layers.size())
        prefetch_rows(layers[index + 1].qkv, share(layers[index + 1].qkv, 0, Nq, d, tid, nth).first);
#pragma omp barrier
    }
  }
}

}  // namespace

// hidden [D, Hd] float32 (the embedded new tokens, one per sequence); cos/sin [D, d] float32; norms: input and
// post-attention norm weight per layer; linears: (weight, scale, bias) per linear part, empty where a scale or
// bias is absent; parts: per layer the number of linears making q/k/v, o, gate/up and down (4 ints); eps: 2 per
// layer; k_caches/v_caches [slots, KVH, d] float32 or bfloat16 per layer; new_slots [D]; ctx_slots [D, L];
// starts/lengths [D] -> hidden after all layers [D, Hd] float32. The Llama/Qwen2 decoder layer, SiLU MLP.
at::Tensor decode_layers(at::Tensor hidden, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> norms,
                            std::vector<at::Tensor> linears, std::vector<int64_t> parts, std::vector<double> eps,
                            std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                            at::Tensor new_slots, at::Tensor ctx_slots, at::Tensor starts,
                            at::Tensor lengths, int64_t H, int64_t KVH, double scale) {
  RECORD_FUNCTION("qpack::decode_layers", std::vector<c10::IValue>());
  const size_t num_layers = k_caches.size();
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden: [D, Hd] float32");
  TORCH_CHECK(norms.size() == 2 * num_layers && parts.size() == 4 * num_layers && eps.size() == 2 * num_layers &&
                  v_caches.size() == num_layers,
              "per layer: 2 norms, 4 part counts, 2 eps, a k and a v cache");
  auto h = hidden.contiguous().clone();
  const int64_t D = h.size(0), Hd = h.size(1), d = cos.size(1), Nq = (H + 2 * KVH) * d;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == D && cos.scalar_type() == at::kFloat, "cos/sin: [D, d]");
  TORCH_CHECK(H % KVH == 0 && d % 2 == 0, "heads");
  auto c = cos.contiguous(), s = sin.contiguous();
  auto ns = new_slots.contiguous(), cs = ctx_slots.contiguous(), st = starts.contiguous(), ln = lengths.contiguous();
  TORCH_CHECK(ns.scalar_type() == at::kLong && cs.scalar_type() == at::kLong && st.scalar_type() == at::kLong &&
                  ln.scalar_type() == at::kLong,
              "slots, starts, lengths: int64");
  TORCH_CHECK(ns.numel() == D && cs.dim() == 2 && cs.size(0) == D && st.numel() == D && ln.numel() == D, "slot shapes");
  const auto kv_type = k_caches.empty() ? at::kFloat : k_caches[0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "KV cache must be float32 or bfloat16");
  std::vector<Layer> layers(num_layers);
  size_t next = 0;
  auto proj = [&](int64_t count, int64_t K, int64_t N, const char* what) {
    Proj P;
    for (int64_t j = 0; j < count; ++j, next += 4) {
      TORCH_CHECK(next + 4 <= linears.size(), "linears: 4 tensors per part");
      const Lin L = as_lin(linears[next], linears[next + 1], linears[next + 2], linears[next + 3]);
      TORCH_CHECK(L.K == K || (L.K > K && L.kind != at::kByte), what, ": weight holds ", L.K, " inputs, expected ", K);
      P.add(L);
    }
    TORCH_CHECK(N < 0 || P.N == N, what, ": ", P.N, " output rows, expected ", N);
    return P;
  };
  int64_t I = -1;
  for (size_t i = 0; i < num_layers; ++i) {
    for (size_t j : {2 * i, 2 * i + 1})
      TORCH_CHECK(norms[j].scalar_type() == at::kFloat && norms[j].numel() == Hd && norms[j].is_contiguous(),
                  "norm weights: [Hd] float32");
    Layer& ly = layers[i];
    ly.input_norm = norms[2 * i].data_ptr<float>();
    ly.post_norm = norms[2 * i + 1].data_ptr<float>();
    ly.input_eps = static_cast<float>(eps[2 * i]);
    ly.post_eps = static_cast<float>(eps[2 * i + 1]);
    ly.qkv = proj(parts[4 * i], Hd, Nq, "q/k/v");
    ly.o = proj(parts[4 * i + 1], H * d, Hd, "o");
    ly.gate_up = proj(parts[4 * i + 2], Hd, I < 0 ? -1 : 2 * I, "gate/up");
    TORCH_CHECK(ly.gate_up.N % 2 == 0, "gate/up: an even number of rows");
    I = ly.gate_up.N / 2;
    ly.down = proj(parts[4 * i + 3], I, Hd, "down");
    for (auto* cache : {&k_caches[i], &v_caches[i]})
      TORCH_CHECK(cache->is_contiguous() && cache->scalar_type() == kv_type && cache->dim() == 3 &&
                      cache->size(1) == KVH && cache->size(2) == d,
                  "caches: [slots, KVH, d], one dtype");
    ly.k_cache = k_caches[i].data_ptr();
    ly.v_cache = v_caches[i].data_ptr();
  }
  TORCH_CHECK(next == linears.size(), "linears: more tensors than the part counts name");
  I = std::max<int64_t>(I, 0);
  auto opts = h.options();
  auto qkv = at::empty({D, Nq}, opts), att = at::empty({D, H * d}, opts);
  auto act = at::empty({D, 2 * I}, opts), mid = at::empty({D, I}, opts);
  const int64_t L = cs.size(1);
  const float sc = static_cast<float>(scale);
  if (kv_type == at::kFloat)
    run_layers<float>(h.data_ptr<float>(), D, Hd, c.data_ptr<float>(), s.data_ptr<float>(), layers,
                      ns.data_ptr<int64_t>(), cs.data_ptr<int64_t>(), st.data_ptr<int64_t>(), ln.data_ptr<int64_t>(),
                      L, H, KVH, d, sc, qkv.data_ptr<float>(), att.data_ptr<float>(),
                      act.data_ptr<float>(), mid.data_ptr<float>(), I);
  else
    run_layers<at::BFloat16>(h.data_ptr<float>(), D, Hd, c.data_ptr<float>(), s.data_ptr<float>(), layers,
                             ns.data_ptr<int64_t>(), cs.data_ptr<int64_t>(), st.data_ptr<int64_t>(),
                             ln.data_ptr<int64_t>(), L, H, KVH, d, sc, qkv.data_ptr<float>(),
                             att.data_ptr<float>(), act.data_ptr<float>(), mid.data_ptr<float>(), I);
  return h;
}

}  // namespace qpack
