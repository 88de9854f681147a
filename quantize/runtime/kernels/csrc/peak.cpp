// The machine's own multiply-add ceilings, which the prompt benchmark states its kernels against
// (benchmarks/prefill.py): int16 pairs (`vpmaddwd` on AVX2, `vpdpwssd` on AVX-512: the instruction every exact
// int8/int4 prompt GEMM is built on), unsigned x signed byte pairs (256-bit `vpmaddubsw`, in every build: the int4
// GEMM over int8 activations, gemm_a8.h) and float32 FMA (what torch's FP32 GEMM runs on). Each thread runs
// kChains independent dependency chains of the one instruction, enough to cover its latency, so the loop is
// bound by how many the core issues per cycle and nothing else; all torch threads run at once.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "ops.h"
#include "simd.h"

namespace qpack {
namespace {

constexpr int kChains = 12;

#ifdef QPACK_AVX512
using IVec = __m512i;
using FVec = __m512;
constexpr int64_t kMacsI16 = 32, kMacsF32 = 16;  // per instruction
inline IVec iset(int v) { return _mm512_set1_epi32(v); }
inline FVec fset(float v) { return _mm512_set1_ps(v); }
inline IVec imadd(IVec acc, IVec a, IVec b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline FVec fmadd(FVec acc, FVec a, FVec b) { return _mm512_fmadd_ps(a, b, acc); }
inline int32_t lane(IVec v) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(v)); }
inline int32_t lane(__m256i v) { return _mm_cvtsi128_si32(_mm256_castsi256_si128(v)); }
inline float lane(FVec v) { return _mm512_cvtss_f32(v); }
#else
using IVec = __m256i;
using FVec = __m256;
constexpr int64_t kMacsI16 = 16, kMacsF32 = 8;
inline IVec iset(int v) { return _mm256_set1_epi32(v); }
inline FVec fset(float v) { return _mm256_set1_ps(v); }
// vpmaddwd alone (its int32 result fed back as the next pair of int16 inputs: the values are meaningless, the
// issue rate is the instruction's).
inline IVec imadd(IVec acc, IVec a, IVec) { return _mm256_madd_epi16(acc, a); }
inline FVec fmadd(FVec acc, FVec a, FVec b) { return _mm256_fmadd_ps(a, b, acc); }
inline int32_t lane(IVec v) { return _mm_cvtsi128_si32(_mm256_castsi256_si128(v)); }
inline float lane(FVec v) { return _mm256_cvtss_f32(v); }
#endif
constexpr int64_t kMacsU8 = 32;  // 256-bit vpmaddubsw, fed back as in imadd

template <typename V, typename Step>
double chains(int64_t iterations, V a, V b, Step step, double& sink) {
  V acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = a;
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = step(acc[c], a, b);
  double s = 0;
  for (int c = 0; c < kChains; ++c) s += lane(acc[c]);
  sink += s;
  return static_cast<double>(iterations) * kChains;
}

}  // namespace

double peak_rate(const std::string& kind, int64_t iterations) {
  TORCH_CHECK(kind == "int16" || kind == "int8" || kind == "fp32", "peak_rate: kind is 'int16', 'int8' or 'fp32'");
  TORCH_CHECK(iterations > 0, "peak_rate: iterations > 0");
  const int threads = at::get_num_threads();
  double instructions = 0, sink = 0;
  const auto began = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : instructions, sink)
  {
    if (kind == "int16")
      instructions += chains(iterations, iset(3), iset(5), [](IVec c, IVec a, IVec b) { return imadd(c, a, b); }, sink);
    else if (kind == "int8")
      instructions += chains(iterations, _mm256_set1_epi8(3), _mm256_set1_epi8(5),
                             [](__m256i c, __m256i a, __m256i) { return _mm256_maddubs_epi16(c, a); }, sink);
    else
      instructions += chains(iterations, fset(1.0f), fset(1e-9f), [](FVec c, FVec a, FVec b) { return fmadd(c, a, b); }, sink);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  volatile double keep = sink;
  (void)keep;
  const int64_t macs = kind == "int16" ? kMacsI16 : kind == "int8" ? kMacsU8 : kMacsF32;
  return instructions * static_cast<double>(macs) / seconds;
}

}  // namespace qpack
