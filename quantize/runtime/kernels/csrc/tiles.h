// Register tiles of the int8 linear kernel from 8 activation rows (batched decode, short prompts, the
// batch-invariant prefill): MB activation rows by NB weight rows per pass, so a weight vector widened once serves
// MB rows and an activation vector loaded once serves NB weight rows; `row_dot_i8` (linear.h) reloads the
// activations for every weight row, which leaves many rows bound by loads instead of multiply-adds.
//
// Every (activation row, weight row) pair goes through exactly the operations the row kernel applies to it: the
// same lanes, the same exact int32 sums within blocks of 2048 inputs, the same float
// additions of the blocks in the same order, the same horizontal sum and tail. So a row's output does not depend
// on the tile it falls in, on M, or on which kernel served it: prefill and decode compute the same bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace qpack {

// Activation rows x weight rows of a tile. int4 weights keep their row kernel: an int4 tile that shares one
// unpacking of the nibbles among 8 rows needs more registers than there are (measured 1.1-1.4x slower than the
// row kernel at 8x2 on AVX-512, at 2x2 on AVX2).
#ifdef QPACK_AVX512
constexpr int kTileRows8 = 4, kTileCols8 = 4;
#else
constexpr int kTileRows8 = 2, kTileCols8 = 4;  // 8 sums, 4 weights, 1 activation, 1 product
#endif

// The horizontal sums of many vectors at once, each summed by exactly the tree `_mm512_reduce_add_ps` (GCC's:
// upper 256 bits + lower, then upper 128 + lower, then elements 0+2 and 1+3, then those two) or `hsum` uses
// (the same from the 128-bit step on): float addition is commutative, so only which pairs are added, in which
// order, decides the bits, and a transposed tree adds the same pairs. sums[i] = the sum of v[i]; v holds 16
// (AVX-512) or 8 (AVX2) vectors, unused ones zero.
#ifdef QPACK_AVX512
inline void reduce_many(const __m512* v, float* sums) {
  __m512 u[8], z[4], r[2];
  for (int p = 0; p < 8; ++p)
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44));
  for (int q = 0; q < 4; ++q)
    z[q] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * q], u[2 * q + 1], 0xDD),
                         _mm512_shuffle_f32x4(u[2 * q], u[2 * q + 1], 0x88));
  for (int s = 0; s < 2; ++s)
    r[s] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * s], z[2 * s + 1], 0xEE), _mm512_shuffle_ps(z[2 * s], z[2 * s + 1], 0x44));
  const __m512 total = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
  float lanes[16];
  _mm512_storeu_ps(lanes, total);
  for (int lane = 0; lane < 4; ++lane)  // 128-bit lane l, element e holds the sum of v[l + 4 e]
    for (int e = 0; e < 4; ++e) sums[lane + 4 * e] = lanes[4 * lane + e];
}
#else
inline void reduce_many(const __m256* v, float* sums) {
  __m256 w[4], r[2];
  for (int p = 0; p < 4; ++p)
    w[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31),
                         _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20));
  for (int s = 0; s < 2; ++s)
    r[s] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * s], w[2 * s + 1], 0xEE), _mm256_shuffle_ps(w[2 * s], w[2 * s + 1], 0x44));
  const __m256 total = _mm256_add_ps(_mm256_shuffle_ps(r[0], r[1], 0x88), _mm256_shuffle_ps(r[0], r[1], 0xDD));
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  for (int lane = 0; lane < 2; ++lane)  // 128-bit lane l, element e holds the sum of v[l + 2 e]
    for (int e = 0; e < 4; ++e) sums[lane + 2 * e] = lanes[4 * lane + e];
}
#endif

// out[j * NB + i] = the horizontal sum of total[j][i], as the row kernels take it.
template <int MB, int NB, typename V>
inline void reduce_tile(const V (&total)[MB][NB], float* out) {
#ifdef QPACK_AVX512
  constexpr int kWidth = 16;
  __m512 v[kWidth];
  for (int t = MB * NB; t < kWidth; ++t) v[t] = _mm512_setzero_ps();
#else
  constexpr int kWidth = 8;
  __m256 v[kWidth];
  for (int t = MB * NB; t < kWidth; ++t) v[t] = _mm256_setzero_ps();
#endif
  static_assert(MB * NB <= kWidth, "a tile's sums fit one transposed reduction");
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) v[j * NB + i] = total[j][i];
  float sums[kWidth];
  reduce_many(v, sums);
  for (int t = 0; t < MB * NB; ++t) out[t] = sums[t];
}

// out[j * NB + i] = sum_k q[j * K + k] * w[i * ldw + k] (as row_dot_i8<MB> sums it) for j < MB, i < NB.
template <int MB, int NB>
inline void tile_dot_i8(const int16_t* q, int64_t K, const int8_t* w, int64_t ldw, float* out) {
#ifdef QPACK_AVX512
  __m512 total[MB][NB];
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) total[j][i] = _mm512_setzero_ps();
  const int64_t K32 = K & ~int64_t(31);
  int64_t k = 0;
  while (k < K32) {
    const int64_t end = std::min<int64_t>(K32, k + 2048);
    __m512i acc[MB][NB];
    for (int j = 0; j < MB; ++j)
      for (int i = 0; i < NB; ++i) acc[j][i] = _mm512_setzero_si512();
    for (; k < end; k += 32) {
      __m512i wv[NB];
      for (int i = 0; i < NB; ++i) prefetch(w + i * ldw + k, 32);
      for (int i = 0; i < NB; ++i)
        wv[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * ldw + k)));
      for (int j = 0; j < MB; ++j) {
        const __m512i a = _mm512_loadu_si512(q + j * K + k);
        for (int i = 0; i < NB; ++i) acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], wv[i], a);
      }
    }
    for (int j = 0; j < MB; ++j)
      for (int i = 0; i < NB; ++i) total[j][i] = _mm512_add_ps(total[j][i], _mm512_cvtepi32_ps(acc[j][i]));
  }
  reduce_tile<MB, NB>(total, out);
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) {
      int32_t tail = 0;
      for (int64_t t = K32; t < K; ++t) tail += static_cast<int32_t>(q[j * K + t]) * w[i * ldw + t];
      out[j * NB + i] += static_cast<float>(tail);
    }
#else
  __m256 total[MB][NB];
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) total[j][i] = _mm256_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  int64_t k = 0;
  while (k < K16) {
    const int64_t end = std::min<int64_t>(K16, k + 2048);
    __m256i acc[MB][NB];
    for (int j = 0; j < MB; ++j)
      for (int i = 0; i < NB; ++i) acc[j][i] = _mm256_setzero_si256();
    for (; k < end; k += 16) {
      __m256i wv[NB];
      for (int i = 0; i < NB; ++i) prefetch(w + i * ldw + k, 16);
      for (int i = 0; i < NB; ++i)
        wv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * ldw + k)));
      for (int j = 0; j < MB; ++j) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k));
        for (int i = 0; i < NB; ++i) acc[j][i] = _mm256_add_epi32(acc[j][i], _mm256_madd_epi16(wv[i], a));
      }
    }
    for (int j = 0; j < MB; ++j)
      for (int i = 0; i < NB; ++i) total[j][i] = _mm256_add_ps(total[j][i], _mm256_cvtepi32_ps(acc[j][i]));
  }
  reduce_tile<MB, NB>(total, out);
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) {
      int32_t tail = 0;
      for (int64_t t = K16; t < K; ++t) tail += static_cast<int32_t>(q[j * K + t]) * w[i * ldw + t];
      out[j * NB + i] += static_cast<float>(tail);
    }
#endif
}

// tile_dot_i8<mb, nb> for a runtime tile shape of at most MB x NB (the edges of a product).
template <int MB, int NB>
inline void tile_i8(int mb, int nb, const int16_t* q, int64_t K, const int8_t* w, int64_t ldw, float* out) {
  if constexpr (MB > 1) {
    if (mb < MB) return tile_i8<MB - 1, NB>(mb, nb, q, K, w, ldw, out);
  }
  if constexpr (NB > 1) {
    if (nb < NB) return tile_i8<MB, NB - 1>(mb, nb, q, K, w, ldw, out);
  }
  tile_dot_i8<MB, NB>(q, K, w, ldw, out);
}

}  // namespace qpack
