// Weight-streaming linear kernels for a few activation rows (decode): each weight row is read once for all
// rows of the activation. float32 and bfloat16 weights multiply float32 activations; int8 and int4 weights
// multiply the activations rounded to int16 per row (exact integer sums). A projection (`Proj`) is one or more
// linears of possibly different weight types whose output rows follow each other; `share` cuts its rows
// between threads by bytes read.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "simd.h"

namespace qpack {

// out[j] = sum_k x[j, k] * w[k] for MB activation rows; U independent accumulator chains per row.
template <typename W, int MB, int U>
inline void row_dot(const float* x, int64_t K, const W* w, float* out) {
#ifdef QPACK_AVX512
  __m512 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    prefetch(w + k, 16 * U);
    for (int u = 0; u < U; ++u) {
      const __m512 wv = load16(w + k + 16 * u);
      for (int j = 0; j < MB; ++j)
        acc[j][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * K + k + 16 * u), acc[j][u]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = load16(w + k);
    for (int j = 0; j < MB; ++j) acc[j][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + j * K + k), acc[j][0]);
  }
  for (int j = 0; j < MB; ++j) {
    for (int u = 1; u < U; ++u) acc[j][0] = _mm512_add_ps(acc[j][0], acc[j][u]);
    float s = _mm512_reduce_add_ps(acc[j][0]);
    for (int64_t t = k; t < K; ++t) s += x[j * K + t] * scalar(w[t]);
    out[j] = s;
  }
#else
  __m256 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    prefetch(w + k, 8 * U);
    for (int u = 0; u < U; ++u) {
      __m256 wv = load8(w + k + 8 * u);
      for (int j = 0; j < MB; ++j)
        acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k + 8 * u), acc[j][u]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv = load8(w + k);
    for (int j = 0; j < MB; ++j) acc[j][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k), acc[j][0]);
  }
  for (int j = 0; j < MB; ++j) {
    for (int u = 1; u < U; ++u) acc[j][0] = _mm256_add_ps(acc[j][0], acc[j][u]);
    float s = hsum(acc[j][0]);
    for (int64_t t = k; t < K; ++t) s += x[j * K + t] * scalar(w[t]);
    out[j] = s;
  }
#endif
}

// A linear layer's weight as the kernels see it: [N, >= K] rows (float32, int8 or bfloat16), optional
// per-row scale and bias.
// kind kByte: int4, two per byte along K (low nibble first), dequantized per group of `group` inputs as
// (q - group_zero) * group_scale.
struct Lin {
  at::ScalarType kind;
  const void* w;
  int64_t ldw, N, K;  // K: the inputs a row holds
  const float* scale;
  const float* bias;
  const at::Half* group_scale = nullptr;
  const uint8_t* group_zero = nullptr;
  int64_t group = 0;
};


// weight [N, >= K] float32, int8 or bfloat16 with scale [N] float32 or empty; or int4 weight [N, K/2] uint8
// with scale [N, K/g] float16 and zero_point [N, K/g] uint8; bias [N] float32 or empty.
Lin as_lin(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias, const at::Tensor& zero_point);

// The activation rows a linear reads: float32 for float/bf16 weights, and for int8 weights also as int16 with
// one scale per row (x ~= q * scale, |q| <= 32767), quantized on first use. int8 x int16 products summed in
// int32 (`vpmaddwd`) convert ~3x fewer values per weight than widening every int8 weight to float, which kept
// the int8 kernel compute-bound at ~half the memory bandwidth; rounding x to 16 bits is ~100x finer than the
// bf16 rounding of torch's `_weight_int8pack_mm`.
struct Act {
  const float* x;
  int64_t M, K;
  int16_t* q;
  float* scale;
  int16_t* q4;  // int4 weights: q with each 32 inputs reordered evens then odds (the nibble order), [M, K]
  int32_t* group_sum;  // and its sums per group of `summed_group` inputs [M, K / group], for the zero points
  bool quantized = false, quantized4 = false;
  int64_t summed_group = 0;
  int8_t* amx_hi = nullptr;  // q split for the AMX GEMM (amx.h), [Mp, amx_k] each, when it runs
  uint8_t* amx_lo = nullptr;
  int64_t amx_k = 0;
  std::vector<int8_t> amx_hi_rows;  // where `amx_split` keeps them
  std::vector<uint8_t> amx_lo_rows;

  // q4 and the per-group sums that the zero points multiply: once per activation and group size, not once
  // per weight row.
  void quantize4(int64_t group) {
    if (!quantized4) {
      quantize();
      for (int64_t m = 0; m < M; ++m) {
        const int16_t* row = q + m * K;
        int16_t* out = q4 + m * K;
        for (int64_t b = 0; b < K / 32; ++b)
          for (int64_t i = 0; i < 16; ++i) {
            out[b * 32 + i] = row[b * 32 + 2 * i];
            out[b * 32 + 16 + i] = row[b * 32 + 2 * i + 1];
          }
      }
      quantized4 = true;
    }
    if (summed_group == group) return;
    const int64_t groups = K / group;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) total += q[m * K + i];
        group_sum[m * groups + g] = total;
      }
    summed_group = group;
  }

  void quantize() {
    if (quantized) return;
    quantize_rows(0, M);
    quantized = true;
  }

  // Rows [m0, m1) of `quantize` (threads may quantize disjoint rows; the caller then sets `quantized`).
  void quantize_rows(int64_t m0, int64_t m1) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      __m256 peaks = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) peaks = _mm256_max_ps(peaks, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + k)));
      float lanes[8];
      _mm256_storeu_ps(lanes, peaks);
      float peak = *std::max_element(lanes, lanes + 8);
      for (; k < K; ++k) peak = std::max(peak, std::fabs(row[k]));
      const float inv = peak > 0.f ? 32767.f / peak : 0.f;
      const __m256 factor = _mm256_set1_ps(inv);
      int16_t* out = q + m * K;
      for (k = 0; k + 16 <= K; k += 16) {  // round to nearest even, as std::nearbyint in the default mode
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), factor));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), factor));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
      }
      for (; k < K; ++k) out[k] = static_cast<int16_t>(std::nearbyint(row[k] * inv));
      scale[m] = peak / 32767.f;
    }
  }
};


// out[j] = float(sum_k q[j, k] * w[k]) over MB int16 activation rows: the sum is exact (int32 lanes within blocks
// of 2048 inputs, each lane summing <= 256 products of magnitude <= 32767 * 128, the blocks' lanes added in
// int64) and rounded to float once. An exact sum has no order, so every kernel that computes it (these rows, the
// register tiles, the prompt GEMMs, on AVX2 or AVX-512) returns the same bits for a row, whatever M or tile.
template <int MB>
inline void row_dot_i8(const int16_t* q, int64_t K, const int8_t* w, float* out) {
  int64_t exact[MB];
  for (int j = 0; j < MB; ++j) exact[j] = 0;
#ifdef QPACK_AVX512
  // vpdpwssd: 32 int8 weights widened once, one fused multiply-add per activation row.
  const int64_t KV = K & ~int64_t(31);
  int64_t k = 0;
  while (k < KV) {
    const int64_t end = std::min<int64_t>(KV, k + 2048);
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_si512();
    for (; k < end; k += 32) {
      prefetch(w + k, 32);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
      for (int j = 0; j < MB; ++j) acc[j] = _mm512_dpwssd_epi32(acc[j], wv, _mm512_loadu_si512(q + j * K + k));
    }
    for (int j = 0; j < MB; ++j) exact[j] += hsum_i64(acc[j]);
  }
#else
  const int64_t KV = K & ~int64_t(15);
  int64_t k = 0;
  while (k < KV) {
    const int64_t end = std::min<int64_t>(KV, k + 2048);
    __m256i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_si256();
    for (; k < end; k += 16) {
      prefetch(w + k, 16);
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
      for (int j = 0; j < MB; ++j)
        acc[j] = _mm256_add_epi32(
            acc[j], _mm256_madd_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k))));
    }
    for (int j = 0; j < MB; ++j) exact[j] += hsum_i64(acc[j]);
  }
#endif
  for (int j = 0; j < MB; ++j) {
    for (int64_t t = KV; t < K; ++t) exact[j] += static_cast<int32_t>(q[j * K + t]) * w[t];
    out[j] = static_cast<float>(exact[j]);
  }
}

// out[j] = sum_k q[j, k] * dequantized w[k] over MB int16 rows (q4 order) for an int4 row: per group g,
// scale * (sum q * nibble - zero * sum q), exact in int32 within the group; group_sum [MB, K / group].
template <int MB>
inline void row_dot_i4(const int16_t* q4, const int32_t* group_sum, int64_t K, const uint8_t* w,
                       const at::Half* group_scale, const uint8_t* group_zero, int64_t group, float* out) {
#ifdef QPACK_AVX512
  // A block's 16 bytes become one register of 32 int16 nibbles, evens then odds (the q4 order): one vpdpwssd
  // per activation row per block.
  const __m128i low = _mm_set1_epi8(0x0F);
  const int64_t groups = K / group, per_group = group / 32;
  __m512 total[MB];
  float zero_terms[MB];
  for (int j = 0; j < MB; ++j) total[j] = _mm512_setzero_ps(), zero_terms[j] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_si512();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      prefetch(w + b * 16, 16);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      const __m256i nibbles = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_and_si128(packed, low)), _mm_and_si128(_mm_srli_epi16(packed, 4), low), 1);
      const __m512i wv = _mm512_cvtepu8_epi16(nibbles);
      for (int j = 0; j < MB; ++j) acc[j] = _mm512_dpwssd_epi32(acc[j], wv, _mm512_loadu_si512(q4 + j * K + b * 32));
    }
    const float s = static_cast<float>(group_scale[g]);
    const int32_t z = group_zero[g];
    for (int j = 0; j < MB; ++j) {
      total[j] = _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(acc[j]), total[j]);
      zero_terms[j] += s * static_cast<float>(z * group_sum[j * groups + g]);
    }
  }
  for (int j = 0; j < MB; ++j) out[j] = _mm512_reduce_add_ps(total[j]) - zero_terms[j];
#else
  const __m128i low = _mm_set1_epi8(0x0F);
  const int64_t groups = K / group, per_group = group / 32;
  __m256 total[MB];
  float zero_terms[MB];
  for (int j = 0; j < MB; ++j) total[j] = _mm256_setzero_ps(), zero_terms[j] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_si256();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      prefetch(w + b * 16, 16);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      const __m256i even = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low));
      const __m256i odd = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low));
      for (int j = 0; j < MB; ++j) {
        const int16_t* qb = q4 + j * K + b * 32;
        const __m256i pe = _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb)));
        const __m256i po = _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 16)));
        acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(pe, po));
      }
    }
    const float s = static_cast<float>(group_scale[g]);
    const int32_t z = group_zero[g];
    for (int j = 0; j < MB; ++j) {
      total[j] = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(acc[j]), total[j]);
      zero_terms[j] += s * static_cast<float>(z * group_sum[j * groups + g]);
    }
  }
  for (int j = 0; j < MB; ++j) out[j] = hsum(total[j]) - zero_terms[j];
#endif
}

// One output from its row's sum: sum * (row scale * weight row scale) + bias, one rounding for the multiply-add
// (explicit, so every kernel stores the same bits whatever the compiler contracts), then what `y` held.
inline float finish(float sum, float scale, float bias, float dst, bool accumulate) {
  return std::fma(sum, scale, bias) + (accumulate ? dst : 0.0f);
}

// Output columns [n0, n1) of y[m, n] (+)= (x[m, :K] . w[n, :K]) * scale[n] + bias[n] for the activation rows
// of `a`; y row stride ldy. Quantizes `a` to int16 on first use by an int8 or int4 weight.
void lin_range(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate = false);

// A projection whose output rows come from one or more linears of possibly different weight types (q/k/v
// where v_proj was kept at 16 bit): part i computes rows offset[i] .. offset[i] + parts[i].N.
struct Proj {
  std::vector<Lin> parts;
  std::vector<int64_t> offset;
  int64_t N = 0;
  void add(const Lin& L) { parts.push_back(L); offset.push_back(N); N += L.N; }
};

// Rows [n0, n1) of a projection, as `lin_range` computes a linear's.
void proj_range(const Proj& P, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate = false);

// This thread's rows of [n0, n1) of a projection, cut at multiples of `unit` rows so that every thread reads
// about the same number of weight bytes (a bf16 part costs twice an int8 one per row).
std::pair<int64_t, int64_t> share(const Proj& P, int64_t n0, int64_t n1, int64_t unit, int64_t tid, int64_t nth);

// The first rows a thread will read of the next stage's weights, requested while it waits at a barrier.
void prefetch_rows(const Proj& P, int64_t n);

}  // namespace qpack
