// Attention pieces of the decode step: Llama RMSNorm of a row, RoPE of a head, and one query head attended
// over a sequence's context read in place from the paged KV pool.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace qpack {

// x [H] -> x * rsqrt(mean(x^2) + eps) * weight.
inline void norm_row(const float* x, const float* weight, int64_t H, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, H) / static_cast<float>(H) + eps);
  for (int64_t e = 0; e < H; ++e) out[e] = x[e] * inv * weight[e];
}

// One query head against a sequence's n context keys, read in place from the paged pool through its slots;
// scores: n floats of scratch; out: d floats.
template <typename T>
inline void attend(const float* qh, const T* k_cache, const T* v_cache, const int64_t* row_slots, int64_t n,
            int64_t slot_stride, int64_t offset, int64_t d, float scale, float* scores, float* out) {
  float peak = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = dot(qh, k_cache + row_slots[t] * slot_stride + offset, d) * scale;
    peak = std::max(peak, scores[t]);
  }
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) total += (scores[t] = std::exp(scores[t] - peak));
  std::fill(out, out + d, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* v = v_cache + row_slots[t] * slot_stride + offset;
    const float p = scores[t] / total;
    for (int64_t e = 0; e < d; ++e) out[e] += p * scalar(v[e]);
  }
}

// x [d] rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (Hugging Face RoPE).
inline void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < half; ++e) {
    const float a = x[e], b = x[e + half];
    x[e] = a * cos[e] - b * sin[e];
    x[e + half] = b * cos[e + half] + a * sin[e + half];
  }
}

}  // namespace qpack
