// The AMX int8 prompt GEMM (amx.h). Compiled into both builds; the tile code exists only in the AVX-512 one and
// runs only where `amx_enabled()`.
#include "amx.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef QPACK_AVX512
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "gemm.h"

namespace qpack {

#ifdef QPACK_AVX512

namespace {

constexpr int kTile = 16;         // rows of a tile, and int32 columns of an output tile
constexpr int64_t kStep = 64;     // inputs per tile multiply
constexpr int64_t kAmxPanel = 32;  // weight rows per packed panel: two output tiles

// The kernel grants a process the tile data state only on request (Linux >= 5.16): without it the first tile
// instruction is SIGILL.
bool os_grants_tiles() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool cpu_has_amx_int8() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 24 & 1) && (edx >> 25 & 1);  // AMX-TILE, AMX-INT8
}

bool amx_possible() {
  static const bool possible = cpu_has_amx_int8() && os_grants_tiles();
  return possible;
}

std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("QPACK_NATIVE_AMX");
    return !(env && std::strcmp(env, "0") == 0) && amx_possible();
  }()};
  return on;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: int32 sums (hi x panel half 0, hi x half 1, lo x half 0, lo x half 1); 4, 5: the activations' hi and
// lo bytes; 6, 7: the two halves of the weight panel. All 16 rows of 64 bytes.
__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTile;
  _tile_loadconfig(&config);
}

// panel[s][h][r][4c + i] = w[n + 16h + c][64s + 4r + i]: per 64 inputs, each half's 16 weight rows as a B tile
// (row r holds inputs 4r .. 4r + 3 of every weight row), zero past K and past the real weight rows.
void pack_panel(const int8_t* w, int64_t ldw, int64_t K, int64_t Kp, int64_t n, int cols, int8_t* panel) {
  const int8_t zeros[64] = {};
  for (int64_t s = 0; s < Kp / kStep; ++s)
    for (int h = 0; h < 2; ++h) {
      __m512i v[kTile];
      for (int c = 0; c < kTile; ++c) {
        const int row = 16 * h + c;
        const int64_t k0 = s * kStep, valid = std::min<int64_t>(kStep, K - k0);
        const int8_t* src = row < cols ? w + (n + row) * ldw + k0 : zeros;
        v[c] = valid >= kStep || row >= cols ? _mm512_loadu_si512(src)
                                             : _mm512_maskz_loadu_epi8((__mmask64(1) << valid) - 1, src);
      }
      transpose_lanes(v);  // 4-byte units: v[r] holds inputs 4r .. 4r + 3 of each of the 16 weight rows
      int8_t* out = panel + (s * 2 + h) * kTile * 64;
      for (int r = 0; r < kTile; ++r) _mm512_storeu_si512(out + r * 64, v[r]);
    }
}

// The 16 x 32 outputs of one block of rows from its tiles: sum = 256 hi + lo, exact (in double: below 2^53),
// rounded to float once, then stored as `finish` stores it.
void store_block(const Lin& L, const Act& a, int64_t m, int64_t n, int cols, const int32_t (&sums)[4][kTile][kTile],
                 float* y, int64_t ldy, bool accumulate) {
  const int64_t rows = std::min<int64_t>(kTile, a.M - m);
  alignas(64) float s[kAmxPanel], b[kAmxPanel];
  for (int c = 0; c < kAmxPanel; ++c) {
    s[c] = L.scale && c < cols ? L.scale[n + c] : 1.0f;
    b[c] = L.bias && c < cols ? L.bias[n + c] : 0.0f;
  }
  const __m512d step = _mm512_set1_pd(256.0);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = y + (m + r) * ldy + n;
    const __m512 row_scale = _mm512_set1_ps(a.scale[m + r]);
    for (int h = 0; h < 2 && 16 * h < cols; ++h) {
      const __m512i hi = _mm512_load_si512(sums[h][r]), lo = _mm512_load_si512(sums[2 + h][r]);
      const __m256 low = _mm512_cvtpd_ps(_mm512_fmadd_pd(
          _mm512_cvtepi32_pd(_mm512_castsi512_si256(hi)), step, _mm512_cvtepi32_pd(_mm512_castsi512_si256(lo))));
      const __m256 high = _mm512_cvtpd_ps(_mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(hi, 1)), step,
                                                          _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(lo, 1))));
      const __m512 sum = _mm512_castpd_ps(
          _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
      const __mmask16 valid = static_cast<__mmask16>(cols - 16 * h >= 16 ? 0xFFFF : (1u << (cols - 16 * h)) - 1);
      const __m512 before = accumulate ? _mm512_maskz_loadu_ps(valid, out + 16 * h) : _mm512_setzero_ps();
      const __m512 value = _mm512_add_ps(
          _mm512_fmadd_ps(sum, _mm512_mul_ps(row_scale, _mm512_load_ps(s + 16 * h)), _mm512_load_ps(b + 16 * h)),
          before);
      _mm512_mask_storeu_ps(out + 16 * h, valid, value);
    }
  }
}

}  // namespace

bool amx_enabled() { return amx_switch().load(); }

bool set_amx(bool on) {
  amx_switch().store(on && amx_possible());
  return amx_enabled();
}

void amx_split_rows(const Act& a, int64_t m0, int64_t m1, int8_t* hi, uint8_t* lo, int64_t Kp) {
  const __m512i low_byte = _mm512_set1_epi16(0xFF);
  for (int64_t m = m0; m < m1; ++m) {
    const int16_t* q = a.q + m * a.K;
    int64_t k = 0;
    for (; k + 32 <= a.K; k += 32) {
      const __m512i v = _mm512_loadu_si512(q + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + m * Kp + k), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + m * Kp + k),
                          _mm512_cvtepi16_epi8(_mm512_and_si512(v, low_byte)));
    }
    for (; k < a.K; ++k) {
      hi[m * Kp + k] = static_cast<int8_t>(q[k] >> 8);
      lo[m * Kp + k] = static_cast<uint8_t>(q[k] & 0xFF);
    }
    std::memset(hi + m * Kp + a.K, 0, Kp - a.K);
    std::memset(lo + m * Kp + a.K, 0, Kp - a.K);
  }
}

void amx_alloc(Act& a) {
  const int64_t Kp = (a.K + kStep - 1) / kStep * kStep, Mp = (a.M + kTile - 1) / kTile * kTile;
  a.amx_hi_rows.assign(Mp * Kp, 0);
  a.amx_lo_rows.assign(Mp * Kp, 0);
  a.amx_hi = a.amx_hi_rows.data(), a.amx_lo = a.amx_lo_rows.data(), a.amx_k = Kp;
}

void amx_split(Act& a) {
  amx_alloc(a);
  amx_split_rows(a, 0, a.M, a.amx_hi, a.amx_lo, a.amx_k);
}

__attribute__((target("amx-tile,amx-int8"))) void gemm_i8_amx(const Lin& L, const Act& a, float* y, int64_t ldy,
                                                               int64_t n0, int64_t n1, bool accumulate) {
  const int8_t* w = static_cast<const int8_t*>(L.w);
  const int64_t Kp = a.amx_k, steps = Kp / kStep, Mp = (a.M + kTile - 1) / kTile * kTile;
  std::vector<int8_t> panel(Kp * kAmxPanel);
  alignas(64) int32_t sums[4][kTile][kTile];
  configure_tiles();
  for (int64_t n = n0; n < n1; n += kAmxPanel) {
    const int cols = static_cast<int>(std::min<int64_t>(kAmxPanel, n1 - n));
    pack_panel(w, L.ldw, a.K, Kp, n, cols, panel.data());
    for (int64_t m = 0; m < Mp; m += kTile) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, a.amx_hi + m * Kp + s * kStep, Kp);
        _tile_loadd(5, a.amx_lo + m * Kp + s * kStep, Kp);
        _tile_loadd(6, panel.data() + (s * 2) * kTile * 64, 64);
        _tile_loadd(7, panel.data() + (s * 2 + 1) * kTile * 64, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
      }
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      store_block(L, a, m, n, cols, sums, y, ldy, accumulate);
    }
  }
  _tile_release();
}

#else  // the AVX2 build: no AMX

bool amx_enabled() { return false; }
bool set_amx(bool) { return false; }
void amx_split_rows(const Act&, int64_t, int64_t, int8_t*, uint8_t*, int64_t) {}
void amx_alloc(Act&) {}
void amx_split(Act&) {}
void gemm_i8_amx(const Lin&, const Act&, float*, int64_t, int64_t, int64_t, bool) {}

#endif

}  // namespace qpack
