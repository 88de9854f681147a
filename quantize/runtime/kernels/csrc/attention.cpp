// Ops for the per-layer decode path: paged decode attention and RMSNorm over rows.
#include "attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/record_function.h>

#include <vector>

#include "ops.h"

namespace qpack {

// q [D, H, d] float32; k_cache, v_cache [slots, KVH, d] float32 or bfloat16; slots [D, L] int64 (each row
// the sequence's context slots in order); starts/lengths [D] int64 (keys starts[i]..lengths[i]-1 are attended,
// a sliding window moves starts) -> [D, H * d] float32.
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                               at::Tensor starts, at::Tensor lengths, double scale) {
  RECORD_FUNCTION("qpack::paged_decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [D, H, d] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3, "caches: [S, KVH, d]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches: one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [D, L]");
  const int64_t D = q.size(0), H = q.size(1), d = q.size(2), KVH = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == d && H % KVH == 0 && slots.size(0) == D, "shapes");
  auto out = at::empty({D, H * d}, q.options());
  auto st = starts.contiguous(), ln = lengths.contiguous();
  const int64_t *sp = slots.data_ptr<int64_t>(), *s0 = st.data_ptr<int64_t>(), *n = ln.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / KVH, slot_stride = KVH * d;
  auto run = [&](auto* k, auto* v) {
    at::parallel_for(0, D * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(std::max<int64_t>(L, 1));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / H, head = task % H, first = s0[i];
        attend(qp + task * d, k, v, sp + i * L + first, n[i] - first, slot_stride, (head / group) * d, d,
               static_cast<float>(scale), scores.data(), op + task * d);
      }
    });
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>()); break;
    case at::kBFloat16: run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "KV cache must be float32 or bfloat16");
  }
  return out;
}

// x [T, H] float32 -> x * rsqrt(mean(x^2) + eps) * weight, per row (Llama RMSNorm, float32 throughout).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  RECORD_FUNCTION("qpack::rms_norm", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [T, H] float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1), "weight: [H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = at::empty_like(x);
  auto w = weight.contiguous();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * H, wp, H, static_cast<float>(eps), op + t * H);
  });
  return out;
}

}  // namespace qpack
