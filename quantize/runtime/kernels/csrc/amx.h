// The int8 prompt GEMM on AMX tiles, where the CPU has AMX-INT8 and the OS grants its state (the AVX-512 build
// only; elsewhere `amx_enabled` is false and nothing here runs).
//
// AMX multiplies int8 by int8 into exact int32 sums (16 x 16 outputs x 64 inputs per instruction). The decode
// kernels' activations are int16, so each is split exactly into a signed high byte and an unsigned low byte,
// q = 256 * hi + lo, and the two products are summed apart (`tdpbssd`, `tdpbusd`) and joined in int64: the same
// exact integer sum as every other int8 kernel computes, rounded to float once, so AMX changes the speed and not
// one bit of the result.
#pragma once

#include <cstdint>

#include "linear.h"

namespace qpack {

// Whether the AMX GEMM may run: the CPU has AMX-TILE and AMX-INT8, the kernel granted this process the tile
// state, and it is switched on (`set_amx`; the environment's QPACK_NATIVE_AMX=0 switches it off at load).
bool amx_enabled();

// Switch the AMX GEMM on or off for this process (on only where the CPU and OS allow it); whether it is on.
bool set_amx(bool on);

// From this many activation rows an int8 product runs on AMX tiles when `amx_enabled()`.
constexpr int64_t kAmxMinRows = 48;

// Whether an int8 product of these activation rows runs on AMX tiles (its int32 tile sums stay exact up to 65536
// inputs).
inline bool amx_takes(int64_t M, int64_t K) { return M >= kAmxMinRows && K <= 65536 && amx_enabled(); }

// The activation rows as AMX reads them: hi [Mp, Kp] int8 and lo [Mp, Kp] uint8 with q = 256 hi + lo, rows padded
// to a multiple of 16 and inputs to a multiple of 64 with zeros (rows [m0, m1) of the real rows).
void amx_split_rows(const Act& a, int64_t m0, int64_t m1, int8_t* hi, uint8_t* lo, int64_t Kp);

// `a`'s own buffers for the split rows, zeroed and sized: a.amx_hi / a.amx_lo / a.amx_k set (rows then filled by
// `amx_split_rows`, by one thread or several).
void amx_alloc(Act& a);

// All of `a`'s (quantized) rows split into its own buffers, on this thread.
void amx_split(Act& a);

// Output columns [n0, n1) of an int8 linear for every row of `a` (split into a.amx_hi / a.amx_lo), stored as the
// other int8 kernels store them.
void gemm_i8_amx(const Lin& L, const Act& a, float* y, int64_t ldy, int64_t n0, int64_t n1, bool accumulate);

}  // namespace qpack
