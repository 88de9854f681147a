// Vector helpers shared by the kernels: 8-wide (AVX2) and 16-wide (AVX-512) loads of float32 and bfloat16,
// horizontal sums, and the software prefetch every weight stream uses.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QPACK_AVX512 1
#endif

namespace qpack {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float scalar(float v) { return v; }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }

// The exact sum of 8 (or 16) int32 lanes, in int64: integer sums do not depend on their order, so every kernel
// that sums the same products exactly gets the same total, whatever its lanes and tiles.
inline int64_t hsum_i64(__m256i v) {
  const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                        _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  const __m128i pair = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  return _mm_cvtsi128_si64(pair) + _mm_extract_epi64(pair, 1);
}

// The sum of 8 int32 lanes in int32 (wrapping, so exact wherever the total fits, whatever the partial sums).
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

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

#ifdef QPACK_AVX512
inline int64_t hsum_i64(__m512i v) {
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// sum_e a[e] * b[e] over n elements, b float32 or bfloat16.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), load8(b + e), acc);
  float s = hsum(acc);
  for (; e < n; ++e) s += a[e] * scalar(b[e]);
  return s;
}

}  // namespace qpack
