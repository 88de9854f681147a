// The int4 prompt GEMM over int8 activations (`--prefill-dtype int8`): the same exact group sums as gemm.h's int4
// GEMM, from half the multiplies.
//
// With activations rounded to int8 (|q| <= 127) and int4 weights kept as their raw nibbles (0..15, the zero point
// subtracted afterwards as zero * sum_g q), a product pair q0 * w0 + q1 * w1 fits int16 with room to spare
// (<= 2 * 127 * 15 = 3810): `vpmaddubsw` (unsigned weight bytes times signed activation bytes) multiplies 32 pairs
// per instruction and eight of its results add in int16 (<= 30480) before one `vpmaddwd` by ones widens them to
// int32. Per 32 multiply-adds that is 1.125 multiply instructions, against 2 `vpmaddwd` on int16 activations:
// the integer multiplier is what bounds the exact GEMM on a 2-core Zen 1 EPYC. The int8 x int8 product gains
// nothing the same way on AVX2 (its pairs reach 32258, so every `vpmaddubsw` needs its own widening multiply, and
// a sign trick besides), so int8 weights keep the int16 GEMM, fed the int8-rounded activations.
//
// Written with 256-bit AVX2 instructions only and used by both builds: a row's bits then come from one code path
// whatever the CPU, and every build's path runs on every machine that runs the kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gemm.h"

namespace qpack {

constexpr int kTallA8 = 3, kWideA8 = 3;  // activation rows x registers of weight rows: 9 int16 sums in registers
constexpr int kPanelA8 = 8 * kWideA8;    // weight rows per packed panel

// sums[j][c] = the exact int32 sums over `quads` groups of four inputs (a multiple of 8) of activation rows j < T
// (int8, row stride lda) times the packed panel's raw nibbles of weight rows c < kPanelA8 ([quad][row][4] bytes);
// sums row stride kPanelA8. Every 8 quads, the int16 sums are widened into int32 in `sums`.
template <int T>
inline void micro_a8(const int8_t* a, int64_t lda, const uint8_t* panel, int64_t quads, int32_t* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t q0 = 0; q0 < quads; q0 += 8) {
    __m256i part[T][kWideA8];
    for (int j = 0; j < T; ++j)
      for (int c = 0; c < kWideA8; ++c) part[j][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t q = q0; q < q0 + 8; ++q) {
      __m256i w[kWideA8];
      for (int c = 0; c < kWideA8; ++c)
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (q * kPanelA8 + c * 8) * 4));
      for (int j = 0; j < T; ++j) {
        const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a + j * lda + 4 * q));
        for (int c = 0; c < kWideA8; ++c) part[j][c] = _mm256_add_epi16(part[j][c], _mm256_maddubs_epi16(w[c], x));
      }
    }
    for (int j = 0; j < T; ++j)
      for (int c = 0; c < kWideA8; ++c) {
        __m256i* s = reinterpret_cast<__m256i*>(sums + j * kPanelA8 + c * 8);
        const __m256i wide = _mm256_madd_epi16(part[j][c], ones);
        _mm256_storeu_si256(s, q0 == 0 ? wide : _mm256_add_epi32(_mm256_loadu_si256(s), wide));
      }
  }
}

// micro_a8<rows> for a runtime count of activation rows, 1 .. kTallA8.
template <int T = kTallA8>
inline void micro_a8_rows(int rows, const int8_t* a, int64_t lda, const uint8_t* panel, int64_t quads, int32_t* sums) {
  if constexpr (T > 1) {
    if (rows < T) return micro_a8_rows<T - 1>(rows, a, lda, panel, quads, sums);
  }
  micro_a8<T>(a, lda, panel, quads, sums);
}

// 16 bytes of an int4 row (32 inputs, low nibble first) as 8 int32 lanes, each the raw nibbles of four consecutive
// inputs in input order.
inline __m256i nibble_quads(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high));
}

// The panel of weight rows n .. n + cols - 1 (zero for the rest of its kPanelA8 rows) over all K inputs:
// panel[quad][c][0..3] = the raw nibbles of row n + c's inputs 4 quad .. 4 quad + 3; w [N, K/2] uint8 rows of
// stride ldw, K a multiple of 32. 8 rows' 8 quads at a time are expanded and transposed in registers.
inline void pack_panel_a8(const uint8_t* w, int64_t ldw, int64_t n, int cols, int64_t K, uint8_t* panel) {
  for (int c0 = 0; c0 < kPanelA8; c0 += 8)
    for (int64_t q = 0; q < K / 4; q += 8) {
      __m256i v[8];
      for (int i = 0; i < 8; ++i)
        v[i] = c0 + i < cols ? nibble_quads(w + (n + c0 + i) * ldw + 2 * q) : _mm256_setzero_si256();
      transpose_lanes(v);
      for (int e = 0; e < 8; ++e)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((q + e) * kPanelA8 + c0) * 4), v[e]);
    }
}

}  // namespace qpack
