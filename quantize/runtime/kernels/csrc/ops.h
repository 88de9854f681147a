// The extension's ops, as bound in bindings.cpp: shapes and dtypes are checked at each op's entry.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace qpack {

// x [M, K] float32 @ weight rows -> [M, N] float32 (linear.cpp).
// activation_bits: 16 (the exact default) or 8 (int8-rounded activations, `--prefill-dtype int8`).
at::Tensor linear(at::Tensor x, at::Tensor weight, at::Tensor scale, at::Tensor bias, at::Tensor zero_point,
                  int64_t activation_bits);

// int4 weights -> float32, in place into `out` (linear.cpp).
void dequantize_int4(at::Tensor qweight, at::Tensor scale, at::Tensor zero_point, at::Tensor out);

// One new token per sequence attended over its paged context (attention.cpp).
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                            at::Tensor starts, at::Tensor lengths, double scale);

// Llama RMSNorm over rows (attention.cpp).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

// All decoder layers of a decode step in one parallel region (decode_layers.cpp).
at::Tensor decode_layers(at::Tensor hidden, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> norms,
                         std::vector<at::Tensor> linears, std::vector<int64_t> parts, std::vector<double> eps,
                         std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor new_slots,
                         at::Tensor ctx_slots, at::Tensor starts, at::Tensor lengths, int64_t H, int64_t KVH,
                         double scale);

// Multiply-adds per second of the int16-pair or float32 FMA instruction at its issue rate, on all torch threads
// (peak.cpp).
double peak_rate(const std::string& kind, int64_t iterations);

}  // namespace qpack
