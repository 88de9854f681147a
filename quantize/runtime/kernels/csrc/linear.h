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
  // The largest |q|: 32767 (int16, the exact default) or 127 (int8 activations, `--prefill-dtype int8`); then
  // q8 [M, K], if given, holds q as bytes too (the int4 x int8 GEMM, gemm_a8.h).
  int32_t top = 32767;
  int8_t* q8 = nullptr;
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
    sum_groups(group);
  }

  // group_sum for groups of `group` inputs (q quantized): once per activation and group size.
  void sum_groups(int64_t group) {
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
      const float limit = static_cast<float>(top);
      const float inv = peak > 0.f ? limit / peak : 0.f;
      const __m256 factor = _mm256_set1_ps(inv);
      int16_t* out = q + m * K;
      for (k = 0; k + 16 <= K; k += 16) {  // round to nearest even, as std::nearbyint in the default mode
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), factor));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), factor));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
      }
      for (; k < K; ++k) out[k] = static_cast<int16_t>(std::nearbyint(row[k] * inv));
      scale[m] = peak / limit;
      if (q8 != nullptr)
        for (k = 0; k < K; ++k) q8[m * K + k] = static_cast<int8_t>(out[k]);
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

// The int4 product, defined exactly as the int8 one is wherever it can be: per group g of a weight row, the
// exact integer sum S_g = sum_{k in g} q[j, k] * (w[k] - zero_g) (|S_g| <= 32767 * 15 * group, int32 lanes for
// groups of at most kInt4MaxGroup inputs); the groups added in order g = 0, 1, ... in double, each term
// scale_g * S_g exact there (an 11-bit float16 significand times a 31-bit integer), the total rounded to float
// once. Every int4 kernel (these rows, the prompt GEMM in gemm.h, AVX2 or AVX-512) adds the same terms in the
// same order, so a row's result does not depend on M, the tile, the thread or the CPU. Where it differs from
// int8's definition: the sum across groups is rounded in double (relative error <= groups * 2^-53, far below the
// float rounding that follows), because float16 scales over a row span more exponents than an int64 holds.
constexpr int64_t kInt4MaxGroup = QPACK_INT4_MAX_GROUP;  // build.py INT4_MAX_GROUP

inline double group_scale_of(at::Half s) { return static_cast<double>(_cvtsh_ss(s.x)); }

// Adds groups g0 .. g0 + count - 1 of one activation row into `total`, in order: lanes[i] holds group g0 + i's 8
// int32 lanes, zero/scale are the weight row's and group_sum the activation row's, all from g0. A full set of 8
// groups is reduced as a transpose (horizontal adds), its zero-point terms, conversions and products 8 at a time;
// fewer, one at a time: the same terms either way, added in the same order.
inline void fold_groups(const int32_t (*lanes)[8], int count, const uint8_t* zero, const int32_t* group_sum,
                        const at::Half* scale, double& total) {
  if (count < 8) {
    for (int i = 0; i < count; ++i) {
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[i]));
      const int32_t exact = hsum_i32(v) - static_cast<int32_t>(zero[i]) * group_sum[i];
      total += group_scale_of(scale[i]) * static_cast<double>(exact);
    }
    return;
  }
  __m256i v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[i]));
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
  const __m256i zeros = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zero)));
  const __m256i exact = _mm256_sub_epi32(
      sums, _mm256_mullo_epi32(zeros, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_sum))));
  const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale)));
  alignas(32) double terms[8];
  _mm256_store_pd(terms, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(scales)),
                                       _mm256_cvtepi32_pd(_mm256_castsi256_si128(exact))));
  _mm256_store_pd(terms + 4, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(scales, 1)),
                                           _mm256_cvtepi32_pd(_mm256_extracti128_si256(exact, 1))));
  for (int i = 0; i < 8; ++i) total += terms[i];
}

// out[j] = the int4 product above, over MB int16 activation rows in q4 order (each 32 inputs: the 16 evens, then
// the 16 odds, the order a block's 16 bytes hold them in their low and high nibbles); group_sum [MB, K / group]
// holds sum_{k in g} q[j, k] for the zero points. A block's bytes are widened once to 16-bit lanes in registers:
// the low nibble is `lane & 15` and the high one `lane >> 4`, no pass through memory. Each group's int32 lanes
// are parked in L1 and reduced eight groups at a time (fold_groups): a horizontal sum per group per row cost as
// much as the group's multiply-adds.
// Group g's int32 lanes for MB activation rows (8 per row: AVX-512's 16 are folded to 8), from per_group blocks
// of 32 inputs; PG > 0 fixes per_group at compile time (groups of 32, 64, 128 inputs), so the blocks of a group
// unroll into one straight run with no loop of two iterations around them.
template <int MB, int PG>
inline void group_lanes_i4(const int16_t* q4, int64_t K, const uint8_t* w, int64_t g, int64_t per_group,
                           int32_t (*lanes)[8][8], int i) {
  const int64_t blocks = PG > 0 ? PG : per_group, first = g * blocks;
  const __m256i low = _mm256_set1_epi16(0x0F);
#ifdef QPACK_AVX512
  __m512i acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_si512();
#else
  __m256i acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_si256();
#endif
  for (int64_t b = first; b < first + blocks; ++b) {
    if (PG >= 4 ? (b & 3) == 0 : PG == 2 ? (b & 1) == 0 : true) prefetch(w + b * 16, PG >= 4 ? 64 : 16 * (PG > 0 ? PG : 1));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16)));
    const __m256i even = _mm256_and_si256(bytes, low), odd = _mm256_srli_epi16(bytes, 4);
#ifdef QPACK_AVX512
    const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
    for (int j = 0; j < MB; ++j) acc[j] = _mm512_dpwssd_epi32(acc[j], wv, _mm512_loadu_si512(q4 + j * K + b * 32));
#else
    for (int j = 0; j < MB; ++j) {
      const int16_t* qb = q4 + j * K + b * 32;
      const __m256i pe = _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb)));
      const __m256i po = _mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 16)));
      acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(pe, po));
    }
#endif
  }
  for (int j = 0; j < MB; ++j) {
#ifdef QPACK_AVX512
    const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(acc[j]), _mm512_extracti64x4_epi64(acc[j], 1));
#else
    const __m256i folded = acc[j];
#endif
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[j][i]), folded);
  }
}

template <int MB, int PG>
inline void row_dot_i4_blocks(const int16_t* q4, const int32_t* group_sum, int64_t K, const uint8_t* w,
                              const at::Half* group_scale, const uint8_t* group_zero, int64_t group, float* out) {
  const int64_t groups = K / group, per_group = group / 32;
  double total[MB];
  alignas(32) int32_t lanes[MB][8][8];
  for (int j = 0; j < MB; ++j) total[j] = 0.0;
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, groups - g0));
    for (int i = 0; i < count; ++i) group_lanes_i4<MB, PG>(q4, K, w, g0 + i, per_group, lanes, i);
    for (int j = 0; j < MB; ++j)
      fold_groups(lanes[j], count, group_zero + g0, group_sum + j * groups + g0, group_scale + g0, total[j]);
  }
  for (int j = 0; j < MB; ++j) out[j] = static_cast<float>(total[j]);
}

template <int MB>
inline void row_dot_i4(const int16_t* q4, const int32_t* group_sum, int64_t K, const uint8_t* w,
                       const at::Half* group_scale, const uint8_t* group_zero, int64_t group, float* out) {
  switch (group) {
    case 32: return row_dot_i4_blocks<MB, 1>(q4, group_sum, K, w, group_scale, group_zero, group, out);
    case 64: return row_dot_i4_blocks<MB, 2>(q4, group_sum, K, w, group_scale, group_zero, group, out);
    case 128: return row_dot_i4_blocks<MB, 4>(q4, group_sum, K, w, group_scale, group_zero, group, out);
    default: return row_dot_i4_blocks<MB, 0>(q4, group_sum, K, w, group_scale, group_zero, group, out);
  }
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
