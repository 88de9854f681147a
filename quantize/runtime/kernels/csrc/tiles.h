// Register tiles of the int8 linear kernel from 8 activation rows (batched decode, short prompts): MB activation
// rows by NB weight rows per pass, so a weight vector widened once serves MB rows and an activation vector loaded
// once serves NB weight rows; `row_dot_i8` (linear.h) reloads the activations for every weight row, which leaves
// many rows bound by loads instead of multiply-adds.
//
// Each (activation row, weight row) pair's sum is exact, as the row kernel's is (int32 lanes within blocks of 2048
// inputs, added in int64), and rounded to float once: so a row's output does not depend on the tile it falls in,
// on M, or on which kernel served it, and prefill and decode compute the same bits.
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

// out[j * NB + i] = sum_k q[j * K + k] * w[i * ldw + k] (as row_dot_i8<MB> sums it) for j < MB, i < NB.
template <int MB, int NB>
inline void tile_dot_i8(const int16_t* q, int64_t K, const int8_t* w, int64_t ldw, float* out) {
  int64_t exact[MB][NB];
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) exact[j][i] = 0;
#ifdef QPACK_AVX512
  const int64_t KV = K & ~int64_t(31);
  int64_t k = 0;
  while (k < KV) {
    const int64_t end = std::min<int64_t>(KV, k + 2048);
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
      for (int i = 0; i < NB; ++i) exact[j][i] += hsum_i64(acc[j][i]);
  }
#else
  const int64_t KV = K & ~int64_t(15);
  int64_t k = 0;
  while (k < KV) {
    const int64_t end = std::min<int64_t>(KV, k + 2048);
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
      for (int i = 0; i < NB; ++i) exact[j][i] += hsum_i64(acc[j][i]);
  }
#endif
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) {
      for (int64_t t = KV; t < K; ++t) exact[j][i] += static_cast<int32_t>(q[j * K + t]) * w[i * ldw + t];
      out[j * NB + i] = static_cast<float>(exact[j][i]);
    }
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
