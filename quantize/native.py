"""Small-batch CPU kernels for the decode step, built on first use: the whole stack of decoder layers for one
new token per sequence in one call, and the pieces it is made of as separate ops (weight-streaming linear for
int8, bf16 and FP32 weights, paged decode attention, RMSNorm).

Decoding a few sequences is a matrix-vector product per linear layer, bound by reading the weights. torch's CPU
paths for it read far below the memory bandwidth on AVX2 machines: `_weight_int8pack_mm` ~5 GB/s (it
converts the activations to bf16 and is compute-bound), MKL's FP32 GEMV for the LM head ~6 GB/s, bf16 `mm`
slower still, against the ~11-17 GB/s that a plain `sum` reads on the same 2-core machine. `linear` streams
each weight row once for all rows of the activation and prefetches ahead of the stream (one core's own misses
read only ~6 GB/s here); int8 weights multiply the activations rounded to int16 per row (`vpmaddwd`, exact
integer sums), which needs a third of the instructions of widening each weight to float and is ~100x finer
than torch's bf16 rounding of the activations; bf16 and FP32 weights multiply FP32 activations.

`decode_layers` runs every decoder layer of a decode step (norm, q/k/v, RoPE, KV write, paged attention, o,
SiLU MLP, residuals) inside one OpenMP region of torch's own threads: each thread takes a byte-balanced share
of each projection's rows, applies RoPE and writes K/V for the heads it computed, and prefetches the start of
its next share while waiting at the barrier between dependent stages. Per layer, Python and ~20 small
tensor ops cost more than reading the weights at batch 1; fused, a SmolLM2-135M int8 step went from ~40-50 ms
to ~25 ms on the 2-core reference machine, ~14 ms of it the layers and ~10 ms the FP32 LM head.

On CPUs with AVX-512 (F/BW/VL) and VNNI the extension is built for them: int8 and int4 rows multiply-accumulate
int16 pairs in one `vpdpwssd` per 32 weights per activation row, FP32/bf16 rows run 16 wide, and the fused step
and small-batch routing take up to 32 rows (16 with the AVX2 build, where more measured no faster); on a 2-core
Xeon that took SmolLM2 int8 decode from 219 to 328 tokens/s at batch 32. `QPACK_NATIVE_ISA=avx2` forces the
AVX2 build.

The extension compiles once per machine and environment (~1 min, cached under qpack's user cache dir) and needs a
C++ compiler and an AVX2+FMA CPU. Nothing builds it behind a user's back: the serving engine calls `enable()`
at start-up (a server pays the minute once, before traffic); until then, and where the compiler or AVX2 is
missing or the build fails, `ready()` is False and the quantized modules keep torch's ops. Results differ
from torch's by float summation order and, for int8 weights, the int16 rounding of activations.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

_log = logging.getLogger("qpack.native")

# Activation rows routed here, per build: measured faster than torch's paths up to 16 rows with the AVX2 kernels
# (2-core AMD EPYC), up to 32 with the AVX-512 VNNI ones (2-core Xeon with AMX).
_MAX_ROWS = {"avx2": 16, "avx512": 32}
AVX512_FEATURES = ("avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni")
_ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma"],
    "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float scalar(float v) { return v; }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The weights stream from DRAM once per step; one core's outstanding misses alone read ~6 GB/s here, a
// software prefetch 4 KB ahead (into the next rows, which follow in memory) ~20% more.
template <typename W>
inline void prefetch(const W* w, int64_t count) {
  constexpr int64_t kAhead = 4096;
  const char* p = reinterpret_cast<const char*>(w) + kAhead;
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(W)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QPACK_AVX512 1
#endif

#ifdef QPACK_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

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
Lin as_lin(const torch::Tensor& w, const torch::Tensor& scale, const torch::Tensor& bias,
           const torch::Tensor& zero_point) {
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "weight: [N, >=K] with contiguous rows");
  const int64_t N = w.size(0);
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == N && bias.is_contiguous()),
              "bias: [N] float32");
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  auto kind = w.scalar_type();
  if (zero_point.numel()) {
    TORCH_CHECK(kind == at::kByte, "int4 weight: [N, K/2] uint8");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == N && scale.is_contiguous(),
                "int4 scale: [N, K/g] float16");
    TORCH_CHECK(zero_point.scalar_type() == at::kByte && zero_point.sizes() == scale.sizes() &&
                    zero_point.is_contiguous(),
                "int4 zero_point: [N, K/g] uint8");
    const int64_t K = 2 * w.size(1), groups = scale.size(1);
    TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % 32 == 0, "int4 groups: a multiple of 32 inputs");
    Lin L{kind, w.data_ptr(), w.stride(0), N, K, nullptr, b};
    L.group_scale = scale.data_ptr<at::Half>();
    L.group_zero = zero_point.data_ptr<uint8_t>();
    L.group = K / groups;
    return L;
  }
  TORCH_CHECK(!scale.numel() || (scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous()),
              "scale: [N] float32");
  TORCH_CHECK(kind == at::kFloat || kind == at::kChar || kind == at::kBFloat16,
              "weight must be float32, int8 or bfloat16 (or uint8 int4 with a zero point)");
  return Lin{kind, w.data_ptr(), w.stride(0), N, w.size(1), scale.numel() ? scale.data_ptr<float>() : nullptr, b};
}

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
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; ++m) {
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
    quantized = true;
  }
};

// out[j] = sum_k q[j, k] * w[k] over MB int16 activation rows, exact in int32 within blocks of 2048 (each
// lane sums <= 256 products of magnitude <= 32767 * 128), blocks summed in float.
template <int MB>
inline void row_dot_i8(const int16_t* q, int64_t K, const int8_t* w, float* out) {
#ifdef QPACK_AVX512
  // vpdpwssd: 32 int8 weights widened once, one fused multiply-add per activation row.
  __m512 total[MB];
  for (int j = 0; j < MB; ++j) total[j] = _mm512_setzero_ps();
  const int64_t K32 = K & ~int64_t(31);
  int64_t k = 0;
  while (k < K32) {
    const int64_t end = std::min<int64_t>(K32, k + 2048);
    __m512i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_si512();
    for (; k < end; k += 32) {
      prefetch(w + k, 32);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
      for (int j = 0; j < MB; ++j) acc[j] = _mm512_dpwssd_epi32(acc[j], wv, _mm512_loadu_si512(q + j * K + k));
    }
    for (int j = 0; j < MB; ++j) total[j] = _mm512_add_ps(total[j], _mm512_cvtepi32_ps(acc[j]));
  }
  for (int j = 0; j < MB; ++j) {
    int32_t tail = 0;
    for (int64_t t = K32; t < K; ++t) tail += static_cast<int32_t>(q[j * K + t]) * w[t];
    out[j] = _mm512_reduce_add_ps(total[j]) + static_cast<float>(tail);
  }
#else
  __m256 total[MB];
  for (int j = 0; j < MB; ++j) total[j] = _mm256_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  int64_t k = 0;
  while (k < K16) {
    const int64_t end = std::min<int64_t>(K16, k + 2048);
    __m256i acc[MB];
    for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_si256();
    for (; k < end; k += 16) {
      prefetch(w + k, 16);
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
      for (int j = 0; j < MB; ++j)
        acc[j] = _mm256_add_epi32(
            acc[j], _mm256_madd_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k))));
    }
    for (int j = 0; j < MB; ++j) total[j] = _mm256_add_ps(total[j], _mm256_cvtepi32_ps(acc[j]));
  }
  for (int j = 0; j < MB; ++j) {
    int32_t tail = 0;
    for (int64_t t = K16; t < K; ++t) tail += static_cast<int32_t>(q[j * K + t]) * w[t];
    out[j] = hsum(total[j]) + static_cast<float>(tail);
  }
#endif
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

inline void store_rows(const Lin& L, int64_t n, const float* out, const float* row_scale, int64_t m, int64_t mb,
                       float* y, int64_t ldy, bool accumulate) {
  const float s = L.scale ? L.scale[n] : 1.0f, b = L.bias ? L.bias[n] : 0.0f;
  for (int64_t j = 0; j < mb; ++j) {
    float& dst = y[(m + j) * ldy + n];
    dst = out[j] * (row_scale ? row_scale[m + j] * s : s) + b + (accumulate ? dst : 0.0f);
  }
}

// Output columns [n0, n1) of y[m, n] (+)= (x[m, :K] . w[n, :K]) * scale[n] + bias[n], m < M; y row stride ldy.
template <typename W>
void lin_cols(const Lin& L, const float* x, int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1,
              bool accumulate) {
  const W* w = static_cast<const W*>(L.w);
  float out[8];
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * L.ldw;
    for (int64_t m = 0; m < M; m += 8) {
      const int64_t mb = std::min<int64_t>(8, M - m);
      const float* xm = x + m * K;
      switch (mb) {
        case 1: row_dot<W, 1, 4>(xm, K, row, out); break;
        case 2: row_dot<W, 2, 2>(xm, K, row, out); break;
        case 3: row_dot<W, 3, 1>(xm, K, row, out); break;
        case 4: row_dot<W, 4, 1>(xm, K, row, out); break;
        case 5: row_dot<W, 5, 1>(xm, K, row, out); break;
        case 6: row_dot<W, 6, 1>(xm, K, row, out); break;
        case 7: row_dot<W, 7, 1>(xm, K, row, out); break;
        default: row_dot<W, 8, 1>(xm, K, row, out); break;
      }
      store_rows(L, n, out, nullptr, m, mb, y, ldy, accumulate);
    }
  }
}

void lin_cols_i8(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  a.quantize();
  const int8_t* w = static_cast<const int8_t*>(L.w);
  const int64_t K = a.K;
  float out[8];
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * L.ldw;
    for (int64_t m = 0; m < a.M; m += 8) {
      const int64_t mb = std::min<int64_t>(8, a.M - m);
      const int16_t* qm = a.q + m * K;
      switch (mb) {
        case 1: row_dot_i8<1>(qm, K, row, out); break;
        case 2: row_dot_i8<2>(qm, K, row, out); break;
        case 3: row_dot_i8<3>(qm, K, row, out); break;
        case 4: row_dot_i8<4>(qm, K, row, out); break;
        case 5: row_dot_i8<5>(qm, K, row, out); break;
        case 6: row_dot_i8<6>(qm, K, row, out); break;
        case 7: row_dot_i8<7>(qm, K, row, out); break;
        default: row_dot_i8<8>(qm, K, row, out); break;
      }
      store_rows(L, n, out, a.scale, m, mb, y, ldy, accumulate);
    }
  }
}

void lin_cols_i4(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  a.quantize4(L.group);
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  const int64_t K = a.K, groups = K / L.group;
  float out[8];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * L.ldw;
    const at::Half* gs = L.group_scale + n * groups;
    const uint8_t* gz = L.group_zero + n * groups;
    for (int64_t m = 0; m < a.M; m += 8) {
      const int64_t mb = std::min<int64_t>(8, a.M - m);
      const int16_t* qm = a.q4 + m * K;
      const int32_t* bs = a.group_sum + m * groups;
      switch (mb) {
        case 1: row_dot_i4<1>(qm, bs, K, row, gs, gz, L.group, out); break;
        case 2: row_dot_i4<2>(qm, bs, K, row, gs, gz, L.group, out); break;
        case 3: row_dot_i4<3>(qm, bs, K, row, gs, gz, L.group, out); break;
        case 4: row_dot_i4<4>(qm, bs, K, row, gs, gz, L.group, out); break;
        case 5: row_dot_i4<5>(qm, bs, K, row, gs, gz, L.group, out); break;
        case 6: row_dot_i4<6>(qm, bs, K, row, gs, gz, L.group, out); break;
        case 7: row_dot_i4<7>(qm, bs, K, row, gs, gz, L.group, out); break;
        default: row_dot_i4<8>(qm, bs, K, row, gs, gz, L.group, out); break;
      }
      store_rows(L, n, out, a.scale, m, mb, y, ldy, accumulate);
    }
  }
}

void lin_range(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate = false) {
  switch (L.kind) {
    case at::kByte: lin_cols_i4(L, a, y, ldy, n0, n1, accumulate); break;
    case at::kFloat: lin_cols<float>(L, a.x, a.M, a.K, y, ldy, n0, n1, accumulate); break;
    case at::kChar: lin_cols_i8(L, a, y, ldy, n0, n1, accumulate); break;
    default: lin_cols<at::BFloat16>(L, a.x, a.M, a.K, y, ldy, n0, n1, accumulate); break;
  }
}

// A projection whose output rows come from one or more linears of possibly different weight types (q/k/v
// where v_proj was kept at 16 bit): part i computes rows offset[i] .. offset[i] + parts[i].N.
struct Proj {
  std::vector<Lin> parts;
  std::vector<int64_t> offset;
  int64_t N = 0;
  void add(const Lin& L) { parts.push_back(L); offset.push_back(N); N += L.N; }
};

void proj_range(const Proj& P, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate = false) {
  for (size_t i = 0; i < P.parts.size(); ++i) {
    const int64_t off = P.offset[i], b = std::max(n0, off), e = std::min(n1, off + P.parts[i].N);
    if (b < e) lin_range(P.parts[i], a, y + off, ldy, b - off, e - off, accumulate);
  }
}

inline int64_t row_bytes(const Lin& L) { return L.ldw * static_cast<int64_t>(c10::elementSize(L.kind)); }

// This thread's rows of [n0, n1) of a projection, cut at multiples of `unit` rows so that every thread reads
// about the same number of weight bytes (a bf16 part costs twice an int8 one per row).
std::pair<int64_t, int64_t> share(const Proj& P, int64_t n0, int64_t n1, int64_t unit, int64_t tid, int64_t nth) {
  auto bytes_before = [&](int64_t n) {
    int64_t total = 0;
    for (size_t i = 0; i < P.parts.size(); ++i) {
      const int64_t b = std::max(n0, P.offset[i]), e = std::min(n, P.offset[i] + P.parts[i].N);
      if (b < e) total += (e - b) * row_bytes(P.parts[i]);
    }
    return total;
  };
  auto cut = [&](int64_t t) {
    if (t <= 0) return n0;
    if (t >= nth) return n1;
    const int64_t target = bytes_before(n1) * t / nth;
    int64_t lo = 0, hi = (n1 - n0) / unit;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (bytes_before(n0 + mid * unit) < target) lo = mid + 1; else hi = mid;
    }
    return std::min(n1, n0 + lo * unit);
  };
  return {cut(tid), cut(tid + 1)};
}

// The first rows a thread will read of the next stage's weights, requested while it waits at a barrier.
void prefetch_rows(const Proj& P, int64_t n) {
  constexpr int64_t kBytes = 8192;
  for (size_t i = 0; i < P.parts.size(); ++i) {
    if (n < P.offset[i] || n >= P.offset[i] + P.parts[i].N) continue;
    const char* p = static_cast<const char*>(P.parts[i].w) + (n - P.offset[i]) * row_bytes(P.parts[i]);
    const int64_t end = (P.parts[i].N - (n - P.offset[i])) * row_bytes(P.parts[i]);
    for (int64_t b = 0; b < std::min(kBytes, end); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), load8(b + e), acc);
  float s = hsum(acc);
  for (; e < n; ++e) s += a[e] * scalar(b[e]);
  return s;
}

inline void norm_row(const float* x, const float* weight, int64_t H, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, H) / static_cast<float>(H) + eps);
  for (int64_t e = 0; e < H; ++e) out[e] = x[e] * inv * weight[e];
}

// One query head against a sequence's n context keys, read in place from the paged pool through its slots;
// scores: n floats of scratch; out: d floats.
template <typename T>
void attend(const float* qh, const T* k_cache, const T* v_cache, const int64_t* row_slots, int64_t n,
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
torch::Tensor decode_layers(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> norms,
                            std::vector<torch::Tensor> linears, std::vector<int64_t> parts, std::vector<double> eps,
                            std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                            torch::Tensor new_slots, torch::Tensor ctx_slots, torch::Tensor starts,
                            torch::Tensor lengths, int64_t H, int64_t KVH, double scale) {
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
  auto qkv = torch::empty({D, Nq}, opts), att = torch::empty({D, H * d}, opts);
  auto act = torch::empty({D, 2 * I}, opts), mid = torch::empty({D, I}, opts);
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

// q [D, H, d] float32; k_cache, v_cache [slots, KVH, d] float32 or bfloat16; slots [D, L] int64 (each row
// the sequence's context slots in order); starts/lengths [D] int64 (keys starts[i]..lengths[i]-1 are attended,
// a sliding window moves starts) -> [D, H * d] float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                               torch::Tensor starts, torch::Tensor lengths, double scale) {
  RECORD_FUNCTION("qpack::paged_decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [D, H, d] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3, "caches: [S, KVH, d]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches: one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 2, "slots: [D, L]");
  const int64_t D = q.size(0), H = q.size(1), d = q.size(2), KVH = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == d && H % KVH == 0 && slots.size(0) == D, "shapes");
  auto out = torch::empty({D, H * d}, q.options());
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
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  RECORD_FUNCTION("qpack::rms_norm", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [T, H] float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1), "weight: [H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  auto w = weight.contiguous();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * H, wp, H, static_cast<float>(eps), op + t * H);
  });
  return out;
}

// x [M, K] float32; weight [N, >= K] (float32, int8 or bfloat16, rows contiguous) with scale [N] float32 or
// empty, or int4 weight [N, K/2] uint8 with scale [N, K/g] float16 and zero_point [N, K/g] uint8; bias [N]
// float32 or empty -> [M, N] float32.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, torch::Tensor bias,
                     torch::Tensor zero_point) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32");
  const Lin L = as_lin(weight, scale, bias, zero_point);
  const int64_t M = x.size(0), K = x.size(1), N = L.N;
  TORCH_CHECK(L.K == K || (L.K > K && L.kind != at::kByte), "weight holds ", L.K, " inputs, x has ", K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool integer = L.kind == at::kChar || L.kind == at::kByte;
  std::vector<int16_t> q(integer ? M * K : 0), q4(L.kind == at::kByte ? M * K : 0);
  std::vector<int32_t> group_sum(L.kind == at::kByte ? M * (K / 32) : 0);
  std::vector<float> row_scale(M);
  Act a{xp, M, K, q.data(), row_scale.data(), q4.data(), group_sum.data()};
  if (L.kind == at::kByte) a.quantize4(L.group);  // before the threads share it
  if (L.kind == at::kChar) a.quantize();
  auto run = [&] {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { lin_range(L, a, yp, N, begin, end); });
  };
  switch (L.kind) {
    case at::kFloat: { RECORD_FUNCTION("qpack::linear_fp32", std::vector<c10::IValue>()); run(); break; }
    case at::kChar: { RECORD_FUNCTION("qpack::linear_int8", std::vector<c10::IValue>()); run(); break; }
    case at::kByte: { RECORD_FUNCTION("qpack::linear_int4", std::vector<c10::IValue>()); run(); break; }
    default: { RECORD_FUNCTION("qpack::linear_bf16", std::vector<c10::IValue>()); run(); break; }
  }
  return y;
}

// qweight [N, K/2] uint8 (low nibble first), scale [N, K/g] float16, zero_point [N, K/g] uint8 -> out [N, K]
// float32 = (q - zero_point) * scale, for the dense (prefill) path: one pass, no temporaries.
void dequantize_int4(torch::Tensor qweight, torch::Tensor scale, torch::Tensor zero_point, torch::Tensor out) {
  RECORD_FUNCTION("qpack::dequantize_int4", std::vector<c10::IValue>());
  const Lin L = as_lin(qweight, scale, torch::empty({0}, qweight.options().dtype(at::kFloat)), zero_point);
  TORCH_CHECK(qweight.is_contiguous(), "qweight: contiguous [N, K/2]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == L.N &&
                  out.size(1) == L.K,
              "out: [N, K] float32, contiguous");
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  float* o = out.data_ptr<float>();
  const int64_t K = L.K, groups = K / L.group, half = L.group / 2;
  at::parallel_for(0, L.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        const float s = static_cast<float>(L.group_scale[n * groups + g]);
        const float z = static_cast<float>(L.group_zero[n * groups + g]);
        const uint8_t* src = w + n * L.ldw + g * half;
        float* dst = o + n * K + g * L.group;
        for (int64_t i = 0; i < half; ++i) {
          dst[2 * i] = (static_cast<float>(src[i] & 0x0F) - z) * s;
          dst[2 * i + 1] = (static_cast<float>(src[i] >> 4) - z) * s;
        }
      }
  });
}

// The GIL is released while a kernel runs (as torch's own ops do): the serving engine steps in a background
// thread, and the HTTP event loop must keep answering during a 10-20 ms decode step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &linear, "small-batch weight-streaming linear", release());
  m.def("decode_attention", &decode_attention, "paged attention of one new token per sequence", release());
  m.def("rms_norm", &rms_norm, "Llama RMSNorm over rows", release());
  m.def("decode_layers", &decode_layers, "decoder layers of a decode step in one parallel region", release());
  m.def("dequantize_int4", &dequantize_int4, "int4 weights to float32 in one pass", release());
}
"""

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None
_isa: str | None = None


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _target_isa() -> str:
    """'avx512' where the CPU has AVX-512 F/BW/VL and VNNI (the int8 and int4 kernels then multiply-accumulate
    int16 pairs in one instruction, 32 lanes wide), else 'avx2'. QPACK_NATIVE_ISA=avx2 builds the AVX2 kernels on
    any machine (to compare, or to test both)."""
    if os.environ.get("QPACK_NATIVE_ISA", "").lower() == "avx2":
        return "avx2"
    capabilities = torch.cpu.get_capabilities()
    return "avx512" if all(capabilities.get(feature) for feature in AVX512_FEATURES) else "avx2"


def isa() -> str | None:
    """The instruction set the loaded kernels were built for ('avx2' or 'avx512'); None when not loaded."""
    return _isa if _module is not None else None


def max_rows() -> int:
    """Activation rows the loaded kernels serve (`takes`) and the fused decode step runs (0 when not loaded)."""
    return _MAX_ROWS[_isa] if _module is not None and _isa is not None else 0


def enable() -> ModuleType | None:
    """Build (first time on this machine) and load the extension; None, with the reason logged and kept in
    `unavailable_reason()`, where it can't be."""
    global _module, _failed, _isa
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("QPACK_NATIVE", "1") == "0":
            _failed = "disabled by QPACK_NATIVE=0"
        elif not _cpu_supported():
            _failed = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2"
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                _ninja_on_path()
                target = _target_isa()
                flags = ["-O3", *_ISA_FLAGS[target], "-fopenmp"]
                name, folder = _build_folder(flags)
                _module = load_inline(
                    name=name,
                    cpp_sources=[_SOURCE],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
                _isa = target
            except Exception as error:  # no compiler, no ninja, a build error: keep torch's kernels
                _failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if _failed is not None:
            _log.info("native small-batch kernels unavailable (%s); using torch's", _failed)
        return _module


STALE_LOCK_S = 600.0  # a build takes ~1 min; a lock this old was left by a process killed mid-build


def _build_folder(flags: list[str]) -> tuple[str, Path]:
    """One build folder per (source, compiler flags, torch, Python environment): torch's build files name the
    environment's include paths, so two venvs sharing a folder would rebuild on every switch, each start holding
    the lock; an AVX-512 build must never load on an AVX2 machine sharing the cache. A lock left by a process
    killed mid-build would make every later start wait forever: clear it when stale."""
    from quantize.models import cache_dir

    key = "\n".join((_SOURCE, " ".join(flags), torch.__version__, sys.prefix, torch.__file__))
    name = f"qpack_native_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder = cache_dir() / "native" / name
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        age = 0.0
    if age > STALE_LOCK_S:
        _log.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)
    return name, folder


def _ninja_on_path() -> None:
    """torch builds with `ninja` from PATH; a venv's own ninja (the `ninja` wheel) is not on PATH when the venv's
    python is run without activating it."""
    import shutil

    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(scripts, "ninja")):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def ready() -> bool:
    """Whether `enable()` has loaded the kernels (never builds anything itself)."""
    return _module is not None


def takes(x: torch.Tensor) -> bool:
    """Whether `linear` serves these activation rows: kernels loaded, CPU, at most `max_rows()` rows, no
    autograd (the kernels have no backward)."""
    return (
        _module is not None
        and x.device.type == "cpu"
        and x.shape[0] <= max_rows()
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def unavailable_reason() -> str | None:
    return _failed


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ weight[:, :K].T (float32/int8/bfloat16) * scale[N] + bias[N] -> [M, N] float32; with
    `zero_point`, weight is int4 [N, K/2] uint8 (low nibble first) dequantized per group as (q - zero_point)
    * scale (both [N, K/g], scale float16, g a multiple of 32).
    Call only when `ready()`. Eager calls go straight to the extension (no dispatcher round trip: a decode
    step makes ~120 of them); inside torch.compile it is the opaque custom op `qpack::small_batch_linear`."""
    empty = x.new_empty(0)
    args = (
        x.contiguous(),
        weight,
        empty if scale is None else scale,
        empty if bias is None else bias.float(),
        empty if zero_point is None else zero_point,
    )
    if torch.compiler.is_compiling():
        return _small_batch_linear(*args)
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.linear(*args)


@torch.library.custom_op("qpack::small_batch_linear", mutates_args=())
def _small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, zero_point: torch.Tensor
) -> torch.Tensor:
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.linear(x, weight, scale, bias, zero_point)


@_small_batch_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, zero_point: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def dequantize_int4(
    qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """qweight [N, K/2] uint8 (low nibble first), scale [N, K/g] float16, zero_point [N, K/g] uint8 (g a multiple
    of 32) -> out [N, K] float32 = (q - zero_point) * scale, written in place. Call only when `ready()`."""
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    module.dequantize_int4(qweight, scale, zero_point, out)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its context, read in place from the paged KV pool.

    q [D, heads, d] float32; k_cache/v_cache [slots, kv_heads, d] float32 or bfloat16; slots [D, L] int64
    (row i: sequence i's context slots in order, padding beyond lengths[i] ignored); keys starts[i] ..
    lengths[i] - 1 are attended -> [D, heads * d] float32. Call only when `ready()`."""
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.decode_attention(q.contiguous(), k_cache, v_cache, slots, starts, lengths, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm of x [T, H] float32 rows (torch's CPU `rms_norm` runs ~8 ops, ~50-90 us a call here).
    Call only when `ready()`."""
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.rms_norm(x.contiguous(), weight, eps)


def decode_layers(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layers: DecodeLayers,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    new_slots: torch.Tensor,
    ctx_slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Decoder layers (Llama/Qwen2: RMSNorm, q/k/v with RoPE, paged attention, o, SiLU gate/up MLP) for one new
    token per sequence, in a single call: one OpenMP region for all layers, the threads meeting at a barrier
    between dependent stages. Through the per-layer Python loop a batch-1 step spent more time in dispatch and
    ~20 small tensor ops per layer than in reading the weights.

    hidden [D, Hd] float32; cos/sin [D, d]; `layers` holds the weights; k_caches/v_caches: each layer's pool
    [slots, kv_heads, d] (float32 or bfloat16), written at new_slots [D]; ctx_slots [D, L], starts/lengths [D]
    as in `decode_attention`. Returns the hidden state after the last layer. Call only when `ready()`."""
    module = _module
    assert module is not None, "native kernels are not loaded: call enable() first"
    return module.decode_layers(
        hidden,
        cos,
        sin,
        layers.norms,
        layers.linears,
        layers.parts,
        layers.eps,
        k_caches,
        v_caches,
        new_slots,
        ctx_slots,
        starts,
        lengths,
        num_heads,
        num_kv_heads,
        scale,
    )


# weight, scale, bias, zero_point: int8 [N, >= K] with scale [N]; bf16 or float32 [N, >= K]; int4 [N, K/2]
# uint8 with float16 scale and uint8 zero_point [N, K/g]. bias [N].
Part = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass
class DecodeLayers:
    """Consecutive decoder layers' tensors in the order `decode_layers` reads them. Each projection (q/k/v, o,
    gate/up, down) is one or more parts, each an int8 (per-row scale), int4 (per-group scale and zero point),
    bf16 or FP32 weight whose output rows follow the previous part's."""

    norms: list[torch.Tensor] = field(default_factory=list)
    linears: list[torch.Tensor] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)

    def add(
        self,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        eps: tuple[float, float],
        projections: list[list[Part]],
    ) -> None:
        assert len(projections) == 4, "q/k/v, o, gate/up, down"
        empty = torch.empty(0)
        self.norms += [input_norm.detach().contiguous(), post_norm.detach().contiguous()]
        self.eps += list(eps)
        for parts in projections:
            self.parts.append(len(parts))
            for weight, scale, bias, zero_point in parts:
                if scale is not None and zero_point is None:
                    scale = scale.to(torch.float32)
                self.linears += [
                    weight.detach(),
                    empty if scale is None else scale.detach().contiguous(),
                    empty if bias is None else bias.detach().to(torch.float32).contiguous(),
                    empty if zero_point is None else zero_point.detach().contiguous(),
                ]
