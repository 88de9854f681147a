// The linear kernels (see linear.h) and the two ops built on them: `linear` for a few activation rows and
// `dequantize_int4` for the dense (prefill) path.
#include "linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>

#include "amx.h"
#include "gemm.h"
#include "gemm_a8.h"
#include "ops.h"
#include "tiles.h"

namespace qpack {

// weight [N, >= K] float32, int8 or bfloat16 with scale [N] float32 or empty; or int4 weight [N, K/2] uint8
// with scale [N, K/g] float16 and zero_point [N, K/g] uint8; bias [N] float32 or empty.
Lin as_lin(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias,
           const at::Tensor& zero_point) {
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
    TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % 32 == 0 && K / groups <= kInt4MaxGroup,
                "int4 groups: a multiple of 32 inputs, at most ", kInt4MaxGroup);
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

namespace {

inline void store_rows(const Lin& L, int64_t n, const float* out, const float* row_scale, int64_t m, int64_t mb,
                       float* y, int64_t ldy, bool accumulate) {
  const float s = L.scale ? L.scale[n] : 1.0f, b = L.bias ? L.bias[n] : 0.0f;
  for (int64_t j = 0; j < mb; ++j) {
    float& dst = y[(m + j) * ldy + n];
    dst = finish(out[j], row_scale ? row_scale[m + j] * s : s, b, dst, accumulate);
  }
}

// Columns n .. n + cols of every row from a panel's exact sums [M, kPanel], each as store_rows stores it, row by row
// (a column at a time would write one cache line per value).
inline void store_panel(const Lin& L, int64_t n, int cols, const int64_t* sums, const float* row_scale, int64_t M,
                        float* y, int64_t ldy, bool accumulate) {
  float s[kPanel], b[kPanel];
  for (int c = 0; c < cols; ++c) s[c] = L.scale ? L.scale[n + c] : 1.0f, b[c] = L.bias ? L.bias[n + c] : 0.0f;
  for (int64_t m = 0; m < M; ++m) {
    float* row = y + m * ldy + n;
    for (int c = 0; c < cols; ++c)
      row[c] = finish(static_cast<float>(sums[m * kPanel + c]), row_scale[m] * s[c], b[c], row[c], accumulate);
  }
}

// Rows per weight-row pass (G) and accumulator chains per row (U) of the float kernels, one pair per weight type
// for every M: a row's sum is then added in the same order whatever rows share its batch (batch invariance,
// serve/runner.py). float32 reads 4 bytes per weight, so one chain keeps up with memory even at M = 1; bfloat16
// needs two.
template <typename W>
struct DotShape {
  static constexpr int G = 8, U = 1;
};
template <>
struct DotShape<at::BFloat16> {
  static constexpr int G = 4, U = 2;
};

// Output columns [n0, n1) of y[m, n] (+)= (x[m, :K] . w[n, :K]) * scale[n] + bias[n], m < M; y row stride ldy.
template <typename W>
void lin_cols(const Lin& L, const float* x, int64_t M, int64_t K, float* y, int64_t ldy, int64_t n0, int64_t n1,
              bool accumulate) {
  constexpr int G = DotShape<W>::G, U = DotShape<W>::U;
  const W* w = static_cast<const W*>(L.w);
  float out[G];
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * L.ldw;
    for (int64_t m = 0; m < M; m += G) {
      const int64_t mb = std::min<int64_t>(G, M - m);
      const float* xm = x + m * K;
      switch (mb) {
        case 1: row_dot<W, 1, U>(xm, K, row, out); break;
        case 2: row_dot<W, 2, U>(xm, K, row, out); break;
        case 3: row_dot<W, 3, U>(xm, K, row, out); break;
        case 4: row_dot<W, 4, U>(xm, K, row, out); break;
        case 5: row_dot<W, G < 5 ? G : 5, U>(xm, K, row, out); break;
        case 6: row_dot<W, G < 6 ? G : 6, U>(xm, K, row, out); break;
        case 7: row_dot<W, G < 7 ? G : 7, U>(xm, K, row, out); break;
        default: row_dot<W, G, U>(xm, K, row, out); break;
      }
      store_rows(L, n, out, nullptr, m, mb, y, ldy, accumulate);
    }
  }
}

// From this many activation rows the int8 kernel runs register tiles (tiles.h): same bits, fewer loads.
// Below it (decode of a few sequences) each weight row is read once for every activation row, as before.
constexpr int64_t kTileMinRows = 8;

// Activation rows a tile pass keeps in cache (~256 KB of int16) while the weight tiles stream past.
inline int64_t row_block(int64_t K, int64_t tile_rows) {
  return std::max<int64_t>(8 * tile_rows, (256 * 1024 / (2 * K)) / tile_rows * tile_rows);
}

// y for a tile's nb columns from n and mb rows from m, each value stored as store_rows stores it.
inline void store_tile(const Lin& L, int64_t n, int nb, const float* out, const float* row_scale, int64_t m, int mb,
                       float* y, int64_t ldy, bool accumulate) {
  float column[16];
  for (int i = 0; i < nb; ++i) {
    for (int j = 0; j < mb; ++j) column[j] = out[j * nb + i];
    store_rows(L, n + i, column, row_scale, m, mb, y, ldy, accumulate);
  }
}

void tiles_i8(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  const int8_t* w = static_cast<const int8_t*>(L.w);
  const int64_t K = a.K, block = row_block(K, kTileRows8);
  float out[kTileRows8 * kTileCols8];
  for (int64_t m0 = 0; m0 < a.M; m0 += block) {
    const int64_t m1 = std::min(a.M, m0 + block);
    for (int64_t n = n0; n < n1; n += kTileCols8) {
      const int nb = static_cast<int>(std::min<int64_t>(kTileCols8, n1 - n));
      for (int64_t m = m0; m < m1; m += kTileRows8) {
        const int mb = static_cast<int>(std::min<int64_t>(kTileRows8, m1 - m));
        tile_i8<kTileRows8, kTileCols8>(mb, nb, a.q + m * K, K, w + n * L.ldw, L.ldw, out);
        store_tile(L, n, nb, out, a.scale, m, mb, y, ldy, accumulate);
      }
    }
  }
}

// From this many activation rows (and an even K) the int8 product runs the packed-panel GEMM (gemm.h): same bits.
constexpr int64_t kGemmMinRows = 48;

void gemm_i8(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  const int8_t* w = static_cast<const int8_t*>(L.w);
  const int64_t K = a.K, M = a.M, depth = depth_for(K);
  std::vector<int16_t> panel(kDepth * kPanel);
  std::vector<int64_t> sums(M * kPanel);
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n1 - n));
    std::fill(sums.begin(), sums.end(), 0);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t pairs = (std::min(K, k0 + depth) - k0) / 2;
      pack_panel_i8(w, L.ldw, n, cols, k0, pairs, panel.data());
      for (int64_t m = 0; m < M; m += kTall) {
        const int rows = static_cast<int>(std::min<int64_t>(kTall, M - m));
        micro_i8_rows(rows, a.q + m * K + k0, K, panel.data(), pairs, sums.data() + m * kPanel);
      }
    }
    store_panel(L, n, cols, sums.data(), a.scale, M, y, ldy, accumulate);
  }
}

void lin_cols_i8(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  a.quantize();
  if (a.amx_hi == nullptr && amx_takes(a.M, a.K)) amx_split(a);  // a thread's own rows (decode_layers)
  if (a.amx_hi != nullptr) return gemm_i8_amx(L, a, y, ldy, n0, n1, accumulate);
  if (a.M >= kGemmMinRows && a.K % 2 == 0) return gemm_i8(L, a, y, ldy, n0, n1, accumulate);
  if (a.M >= kTileMinRows) return tiles_i8(L, a, y, ldy, n0, n1, accumulate);
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

// Rows m .. m + rows - 1 x columns n .. n + cols - 1 of y from an int4 GEMM's double totals (row stride `width`),
// each rounded to float once and stored as store_rows stores it.
inline void store_totals(const Lin& L, int64_t n, int cols, const double* total, int width, const float* row_scale,
                         int64_t m, int rows, float* y, int64_t ldy, bool accumulate) {
  float out[1];
  for (int j = 0; j < rows; ++j)
    for (int c = 0; c < cols; ++c) {
      out[0] = static_cast<float>(total[j * width + c]);
      store_rows(L, n + c, out, row_scale, m + j, 1, y, ldy, accumulate);
    }
}

// The int4 product (linear.h) for prompt-sized activations, from the packed weights: per panel of kPanel weight
// rows, every group's nibbles minus its zero points are packed once as int16 pairs (pack_panel_i4; the panel of
// the whole K stays in L2), then kTall activation rows at a time run the int8 GEMM's micro-kernel group after
// group, which stores the group's exact sums S_g in int32, and add them into double totals as scale_g * S_g, in
// group order: the row kernel's order, so the same bits. The totals of kTall rows stay in L1.
void gemm_i4(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  const int64_t K = a.K, M = a.M, group = L.group, groups = K / group, pairs = group / 2;
  const int64_t group_panel = pairs * kPanel * 2;  // int16 values of one group's packed panel
  std::vector<int16_t> panel(groups * group_panel);
  std::vector<double> scale(groups * kPanel);
  alignas(32) int32_t sums[kTall * kPanel];
  alignas(32) double total[kTall * kPanel];
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n1 - n));
    for (int64_t g = 0; g < groups; ++g) {
      pack_panel_i4(w, L.ldw, L.group_zero, groups, n, cols, g, pairs, panel.data() + g * group_panel);
      for (int c = 0; c < kPanel; ++c)
        scale[g * kPanel + c] = c < cols ? group_scale_of(L.group_scale[(n + c) * groups + g]) : 0.0;
    }
    for (int64_t m = 0; m < M; m += kTall) {
      const int rows = static_cast<int>(std::min<int64_t>(kTall, M - m));
      std::fill(total, total + rows * kPanel, 0.0);
      for (int64_t g = 0; g < groups; ++g) {
        micro_i8_rows<kTall, int32_t>(rows, a.q + m * K + g * group, K, panel.data() + g * group_panel, pairs, sums);
        const double* sg = scale.data() + g * kPanel;
        for (int j = 0; j < rows; ++j)
          for (int c = 0; c < kPanel; c += 4) {
            const __m256d term =
                _mm256_cvtepi32_pd(_mm_load_si128(reinterpret_cast<const __m128i*>(sums + j * kPanel + c)));
            double* t = total + j * kPanel + c;
            _mm256_store_pd(t, _mm256_fmadd_pd(_mm256_loadu_pd(sg + c), term, _mm256_load_pd(t)));
          }
      }
      store_totals(L, n, cols, total, kPanel, a.scale, m, rows, y, ldy, accumulate);
    }
  }
}

// The int4 product for prompt-sized int8 activations (gemm_a8.h): per panel of kPanelA8 weight rows the raw
// nibbles of the whole K are packed once, then kTallA8 activation rows at a time take each group's exact int32
// sums of q * nibble, subtract zero * sum_g q (the row kernel's fold_groups does the same) and add scale_g * S_g
// into double totals in group order: the int4 definition (linear.h), so the same bits as the row kernel computes
// from the same int8-valued activations.
void gemm_i4_a8(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  const int64_t K = a.K, M = a.M, group = L.group, groups = K / group;
  std::vector<uint8_t> panel(K * kPanelA8);
  std::vector<double> scale(groups * kPanelA8);
  std::vector<int32_t> zero(groups * kPanelA8);
  alignas(32) int32_t sums[kTallA8 * kPanelA8];
  alignas(32) double total[kTallA8 * kPanelA8];
  for (int64_t n = n0; n < n1; n += kPanelA8) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanelA8, n1 - n));
    pack_panel_a8(w, L.ldw, n, cols, K, panel.data());
    for (int64_t g = 0; g < groups; ++g)
      for (int c = 0; c < kPanelA8; ++c) {
        scale[g * kPanelA8 + c] = c < cols ? group_scale_of(L.group_scale[(n + c) * groups + g]) : 0.0;
        zero[g * kPanelA8 + c] = c < cols ? L.group_zero[(n + c) * groups + g] : 0;
      }
    for (int64_t m = 0; m < M; m += kTallA8) {
      const int rows = static_cast<int>(std::min<int64_t>(kTallA8, M - m));
      std::fill(total, total + rows * kPanelA8, 0.0);
      for (int64_t g = 0; g < groups; ++g) {
        micro_a8_rows(rows, a.q8 + m * K + g * group, K, panel.data() + g * group * kPanelA8, group / 4, sums);
        const double* sg = scale.data() + g * kPanelA8;
        const int32_t* zg = zero.data() + g * kPanelA8;
        for (int j = 0; j < rows; ++j) {
          const __m256i gsum = _mm256_set1_epi32(a.group_sum[(m + j) * groups + g]);
          for (int c = 0; c < kPanelA8; c += 8) {
            const __m256i exact = _mm256_sub_epi32(
                _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + j * kPanelA8 + c)),
                _mm256_mullo_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(zg + c)), gsum));
            double* t = total + j * kPanelA8 + c;
            _mm256_store_pd(t, _mm256_fmadd_pd(_mm256_loadu_pd(sg + c), _mm256_cvtepi32_pd(_mm256_castsi256_si128(exact)),
                                               _mm256_load_pd(t)));
            _mm256_store_pd(t + 4, _mm256_fmadd_pd(_mm256_loadu_pd(sg + c + 4),
                                                   _mm256_cvtepi32_pd(_mm256_extracti128_si256(exact, 1)),
                                                   _mm256_load_pd(t + 4)));
          }
        }
      }
      store_totals(L, n, cols, total, kPanelA8, a.scale, m, rows, y, ldy, accumulate);
    }
  }
}

void lin_cols_i4(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  if (a.M >= kGemmMinRows && a.q8 != nullptr) {
    a.quantize();
    a.sum_groups(L.group);
    return gemm_i4_a8(L, a, y, ldy, n0, n1, accumulate);
  }
  if (a.M >= kGemmMinRows) {
    a.quantize();
    return gemm_i4(L, a, y, ldy, n0, n1, accumulate);
  }
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

}  // namespace

void lin_range(const Lin& L, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  switch (L.kind) {
    case at::kByte: lin_cols_i4(L, a, y, ldy, n0, n1, accumulate); break;
    case at::kFloat: lin_cols<float>(L, a.x, a.M, a.K, y, ldy, n0, n1, accumulate); break;
    case at::kChar: lin_cols_i8(L, a, y, ldy, n0, n1, accumulate); break;
    default: lin_cols<at::BFloat16>(L, a.x, a.M, a.K, y, ldy, n0, n1, accumulate); break;
  }
}

void proj_range(const Proj& P, Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate) {
  for (size_t i = 0; i < P.parts.size(); ++i) {
    const int64_t off = P.offset[i], b = std::max(n0, off), e = std::min(n1, off + P.parts[i].N);
    if (b < e) lin_range(P.parts[i], a, y + off, ldy, b - off, e - off, accumulate);
  }
}

inline int64_t row_bytes(const Lin& L) { return L.ldw * static_cast<int64_t>(c10::elementSize(L.kind)); }

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

void prefetch_rows(const Proj& P, int64_t n) {
  constexpr int64_t kBytes = 8192;
  for (size_t i = 0; i < P.parts.size(); ++i) {
    if (n < P.offset[i] || n >= P.offset[i] + P.parts[i].N) continue;
    const char* p = static_cast<const char*>(P.parts[i].w) + (n - P.offset[i]) * row_bytes(P.parts[i]);
    const int64_t end = (P.parts[i].N - (n - P.offset[i])) * row_bytes(P.parts[i]);
    for (int64_t b = 0; b < std::min(kBytes, end); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
}

// x [M, K] float32; weight [N, >= K] (float32, int8 or bfloat16, rows contiguous) with scale [N] float32 or
// empty, or int4 weight [N, K/2] uint8 with scale [N, K/g] float16 and zero_point [N, K/g] uint8; bias [N]
// float32 or empty -> [M, N] float32.
at::Tensor linear(at::Tensor x, at::Tensor weight, at::Tensor scale, at::Tensor bias, at::Tensor zero_point,
                  int64_t activation_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(activation_bits == 16 || activation_bits == 8, "activation_bits: 16 or 8, not ", activation_bits);
  const Lin L = as_lin(weight, scale, bias, zero_point);
  const int64_t M = x.size(0), K = x.size(1), N = L.N;
  TORCH_CHECK(L.K == K || (L.K > K && L.kind != at::kByte), "weight holds ", L.K, " inputs, x has ", K);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool integer = L.kind == at::kChar || L.kind == at::kByte;
  const bool rows4 = L.kind == at::kByte && M < kGemmMinRows;  // the int4 row kernel's activations
  const bool bytes8 = L.kind == at::kByte && !rows4 && activation_bits == 8;  // gemm_i4_a8's
  std::vector<int16_t> q(integer ? M * K : 0), q4(rows4 ? M * K : 0);
  std::vector<int8_t> q8(bytes8 ? M * K : 0);
  std::vector<int32_t> group_sum(rows4 || bytes8 ? M * (K / 32) : 0);
  std::vector<float> row_scale(M);
  Act a{xp, M, K, q.data(), row_scale.data(), q4.data(), group_sum.data()};
  a.top = activation_bits == 8 ? 127 : 32767;
  a.q8 = bytes8 ? q8.data() : nullptr;
  if (integer) {  // before the threads share it
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) { a.quantize_rows(begin, end); });
    a.quantized = true;
  }
  if (rows4) a.quantize4(L.group);
  if (bytes8) a.sum_groups(L.group);
  if (L.kind == at::kChar) {
    if (amx_takes(M, K)) {  // split once, by all threads, before they share it
      amx_alloc(a);
      at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        amx_split_rows(a, begin, end, a.amx_hi, a.amx_lo, a.amx_k);
      });
    }
  }
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
void dequantize_int4(at::Tensor qweight, at::Tensor scale, at::Tensor zero_point, at::Tensor out) {
  RECORD_FUNCTION("qpack::dequantize_int4", std::vector<c10::IValue>());
  const Lin L = as_lin(qweight, scale, at::empty({0}, qweight.options().dtype(at::kFloat)), zero_point);
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

}  // namespace qpack
