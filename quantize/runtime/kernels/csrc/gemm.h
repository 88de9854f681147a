// The int8 linear for prompt-sized activations (many rows): a packed-panel GEMM in the outer-product form that
// dense GEMM libraries use, instead of the dot-product form of the decode kernels (linear.h, tiles.h).
//
// A panel of kPanel weight rows is widened to int16 and packed once per block of kDepth inputs, as
// [pair][row][2] (two inputs of one weight row in each 32-bit lane), into a buffer that stays in L1/L2 while every
// activation row passes it: a micro-kernel keeps kTall activation rows x kPanel weight rows of int32 sums in
// registers and, per input pair, broadcasts each row's two int16 activations and multiply-adds them into all
// weight rows at once (`vpdpwssd`, or `vpmaddwd` + add on AVX2). Each lane sums at most kDepth products of
// magnitude <= 32767 * 128 (< 2^31), so it is exact; the blocks are added in int64 and the total rounded to float
// once, which is exactly what the decode kernels compute: the same bits for a row, whatever kernel, M or tile.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace qpack {

#ifdef QPACK_AVX512
constexpr int kVec = 16;  // int32 lanes per register
constexpr int kTall = 12, kWide = 2;  // activation rows x registers of weight rows: 24 sums in registers
#else
constexpr int kVec = 8;
constexpr int kTall = 4, kWide = 3;  // 12 sums, 3 weights, 1 activation
#endif
constexpr int kPanel = kVec * kWide;  // weight rows per packed panel
constexpr int64_t kDepth = 512;       // inputs per block: each int32 lane sums <= 512 products, exact

// sums[j][c] += the exact int32 sums over `pairs` input pairs of activation rows j < T (int16, row stride lda,
// read two at a time) and the packed panel's weight rows c < kPanel; sums row stride kPanel, in int64. With
// S = int32_t the block's sums are stored instead (an int4 group's, whose terms are small enough: gemm_i4).
template <int T, typename S = int64_t>
inline void micro_i8(const int16_t* a, int64_t lda, const int16_t* panel, int64_t pairs, S* sums) {
#ifdef QPACK_AVX512
  __m512i acc[T][kWide];
  for (int j = 0; j < T; ++j)
    for (int c = 0; c < kWide; ++c) acc[j][c] = _mm512_setzero_si512();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i w[kWide];
    for (int c = 0; c < kWide; ++c) w[c] = _mm512_loadu_si512(panel + (p * kPanel + c * kVec) * 2);
    for (int j = 0; j < T; ++j) {
      const __m512i x = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + j * lda + 2 * p));
      for (int c = 0; c < kWide; ++c) acc[j][c] = _mm512_dpwssd_epi32(acc[j][c], x, w[c]);
    }
  }
  if constexpr (std::is_same_v<S, int32_t>) {
    for (int j = 0; j < T; ++j)
      for (int c = 0; c < kWide; ++c) _mm512_storeu_si512(sums + j * kPanel + c * kVec, acc[j][c]);
    return;
  }
  for (int j = 0; j < T; ++j)
    for (int c = 0; c < kWide; ++c) {
      int64_t* s = reinterpret_cast<int64_t*>(sums) + j * kPanel + c * kVec;
      const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[j][c]));
      const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[j][c], 1));
      _mm512_storeu_si512(s, _mm512_add_epi64(_mm512_loadu_si512(s), lo));
      _mm512_storeu_si512(s + 8, _mm512_add_epi64(_mm512_loadu_si512(s + 8), hi));
    }
#else
  __m256i acc[T][kWide];
  for (int j = 0; j < T; ++j)
    for (int c = 0; c < kWide; ++c) acc[j][c] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i w[kWide];
    for (int c = 0; c < kWide; ++c)
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (p * kPanel + c * kVec) * 2));
    for (int j = 0; j < T; ++j) {
      const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a + j * lda + 2 * p));
      for (int c = 0; c < kWide; ++c) acc[j][c] = _mm256_add_epi32(acc[j][c], _mm256_madd_epi16(x, w[c]));
    }
  }
  if constexpr (std::is_same_v<S, int32_t>) {
    for (int j = 0; j < T; ++j)
      for (int c = 0; c < kWide; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + j * kPanel + c * kVec), acc[j][c]);
    return;
  }
  for (int j = 0; j < T; ++j)
    for (int c = 0; c < kWide; ++c) {
      int64_t* s = reinterpret_cast<int64_t*>(sums) + j * kPanel + c * kVec;
      const __m256i lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc[j][c]));
      const __m256i hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc[j][c], 1));
      __m256i* s0 = reinterpret_cast<__m256i*>(s);
      __m256i* s1 = reinterpret_cast<__m256i*>(s + 4);
      _mm256_storeu_si256(s0, _mm256_add_epi64(_mm256_loadu_si256(s0), lo));
      _mm256_storeu_si256(s1, _mm256_add_epi64(_mm256_loadu_si256(s1), hi));
    }
#endif
}

// micro_i8<rows> for a runtime count of activation rows, 1 .. kTall (the last rows of a product).
template <int T = kTall, typename S = int64_t>
inline void micro_i8_rows(int rows, const int16_t* a, int64_t lda, const int16_t* panel, int64_t pairs, S* sums) {
  if constexpr (T > 1) {
    if (rows < T) return micro_i8_rows<T - 1, S>(rows, a, lda, panel, pairs, sums);
  }
  micro_i8<T, S>(a, lda, panel, pairs, sums);
}

// The transpose of 8 (AVX2, in every build) or 16 (AVX-512) vectors of 32-bit elements: v[i] element e becomes
// v[e] element i.
inline void transpose_lanes(__m256i (&v)[8]) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  // v[r + c], r = 0, 4: in each 128-bit lane L, element 4L + c of rows r .. r + 3.
  for (int r = 0; r < 8; r += 4) {
    v[r] = _mm256_unpacklo_epi64(t[r], t[r + 2]);
    v[r + 1] = _mm256_unpackhi_epi64(t[r], t[r + 2]);
    v[r + 2] = _mm256_unpacklo_epi64(t[r + 1], t[r + 3]);
    v[r + 3] = _mm256_unpackhi_epi64(t[r + 1], t[r + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2x128_si256(v[c], v[c + 4], 0x20);
    t[c + 4] = _mm256_permute2x128_si256(v[c], v[c + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) v[i] = t[i];
}
#ifdef QPACK_AVX512
inline void transpose_lanes(__m512i (&v)[kVec]) {
  __m512i t[kVec];
  for (int i = 0; i < kVec; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  // v[r + c], r = 0, 4, 8, 12: in each 128-bit lane L, element 4L + c of rows r .. r + 3.
  for (int r = 0; r < kVec; r += 4) {
    v[r] = _mm512_unpacklo_epi64(t[r], t[r + 2]);
    v[r + 1] = _mm512_unpackhi_epi64(t[r], t[r + 2]);
    v[r + 2] = _mm512_unpacklo_epi64(t[r + 1], t[r + 3]);
    v[r + 3] = _mm512_unpackhi_epi64(t[r + 1], t[r + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i low_even = _mm512_shuffle_i32x4(v[c], v[c + 4], 0x88);  // lanes 0, 2 of rows 0-3, 4-7
    const __m512i low_odd = _mm512_shuffle_i32x4(v[c], v[c + 4], 0xDD);
    const __m512i high_even = _mm512_shuffle_i32x4(v[c + 8], v[c + 12], 0x88);
    const __m512i high_odd = _mm512_shuffle_i32x4(v[c + 8], v[c + 12], 0xDD);
    t[c] = _mm512_shuffle_i32x4(low_even, high_even, 0x88);
    t[c + 8] = _mm512_shuffle_i32x4(low_even, high_even, 0xDD);
    t[c + 4] = _mm512_shuffle_i32x4(low_odd, high_odd, 0x88);
    t[c + 12] = _mm512_shuffle_i32x4(low_odd, high_odd, 0xDD);
  }
  for (int i = 0; i < kVec; ++i) v[i] = t[i];
}
inline __m512i widen_pairs(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_vec(int16_t* p, __m512i v) { _mm512_storeu_si512(p, v); }
#else
inline __m256i widen_pairs(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_vec(int16_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
#endif

// panel[p][c][0..1] = w[n + c][k0 + 2p .. k0 + 2p + 1] widened to int16, for c < cols (zero for the rest of the
// panel's rows), p < pairs: kVec rows' kVec pairs at a time are widened and transposed in registers.
inline void pack_panel_i8(const int8_t* w, int64_t ldw, int64_t n, int cols, int64_t k0, int64_t pairs,
                          int16_t* panel) {
  using Vec = decltype(widen_pairs(w));
  const int8_t zeros[2 * kVec] = {};
  for (int c0 = 0; c0 < kPanel; c0 += kVec) {
    int64_t p = 0;
    for (; p + kVec <= pairs; p += kVec) {
      Vec v[kVec];
      for (int i = 0; i < kVec; ++i)
        v[i] = widen_pairs(c0 + i < cols ? w + (n + c0 + i) * ldw + k0 + 2 * p : zeros);
      transpose_lanes(v);
      for (int e = 0; e < kVec; ++e) store_vec(panel + ((p + e) * kPanel + c0) * 2, v[e]);
    }
    for (; p < pairs; ++p)
      for (int i = 0; i < kVec; ++i) {
        const bool real = c0 + i < cols;
        const int8_t* src = w + (n + c0 + i) * ldw + k0 + 2 * p;
        panel[(p * kPanel + c0 + i) * 2] = real ? src[0] : 0;
        panel[(p * kPanel + c0 + i) * 2 + 1] = real ? src[1] : 0;
      }
  }
}

// kVec bytes of an int4 row (each the nibbles of two inputs) as kVec int32 lanes, each the pair (low - zero,
// high - zero) as two int16: what pack_panel_i8's widen_pairs gives for two int8 inputs.
#ifdef QPACK_AVX512
inline __m512i nibble_pairs(const uint8_t* p, int32_t zero) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i z = _mm512_set1_epi32(zero);
  const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), z);
  const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), z);
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}
#else
inline __m256i nibble_pairs(const uint8_t* p, int32_t zero) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i z = _mm256_set1_epi32(zero);
  const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), z);
  const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), z);
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}
#endif

// The int4 panel of group g: panel[p][c][0..1] = (w - zero) of weight row n + c's inputs 2p, 2p + 1 of the group
// (one byte: low nibble, high nibble) as int16, for c < cols (zero for the rest), p < pairs = group / 2 (a multiple
// of kVec); w [N, K/2] uint8 rows of stride ldw, zero [N, groups]. kVec bytes of a row become kVec int32 lanes of
// pairs in registers, then transpose_lanes lays them out as pack_panel_i8 does.
inline void pack_panel_i4(const uint8_t* w, int64_t ldw, const uint8_t* zero, int64_t groups, int64_t n, int cols,
                          int64_t g, int64_t pairs, int16_t* panel) {
  using Vec = decltype(widen_pairs(static_cast<const int8_t*>(nullptr)));
  for (int c0 = 0; c0 < kPanel; c0 += kVec) {
    for (int64_t p = 0; p < pairs; p += kVec) {
      Vec v[kVec];
      for (int i = 0; i < kVec; ++i) {
        const int64_t row = n + c0 + i;
        v[i] = c0 + i < cols ? nibble_pairs(w + row * ldw + g * pairs + p, zero[row * groups + g]) : Vec{};
      }
      transpose_lanes(v);
      for (int e = 0; e < kVec; ++e) store_vec(panel + ((p + e) * kPanel + c0) * 2, v[e]);
    }
  }
}

// Inputs per block for a K: as even as kDepth allows (576 is two blocks of 288, not 512 and 64: a block's
// sums are added to memory at its end), and even.
inline int64_t depth_for(int64_t K) {
  const int64_t blocks = (K + kDepth - 1) / kDepth;
  const int64_t depth = (K + blocks - 1) / blocks;
  return depth + (depth & 1);
}

}  // namespace qpack
