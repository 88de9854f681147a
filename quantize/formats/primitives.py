"""Quantization math as pure tensor functions: no modules, no I/O, no model knowledge.

Every scheme, algorithm (RTN, GPTQ, AWQ, SmoothQuant) and kernel path goes through these few functions, so
the grid a weight is rounded onto is defined exactly once and tests can pin it against hand-computed values.
Conventions: weights are `[out_features, in_features]` (`N x K`, like `nn.Linear`); int8 weights are symmetric
per output channel (`w ≈ q * scale`, q in [-127, 127]); int4 weights are asymmetric per group of `group_size`
input channels (`w ≈ (q - zero_point) * scale`, q and zero_point in [0, 15]); activations for W8A8 are
symmetric per token.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_MAX = 15
_EPS = 1e-12


def int8_channel_scale(weight: torch.Tensor) -> torch.Tensor:
    # weight: [N, K] -> scale: [N] float32
    return (weight.detach().abs().amax(dim=1).to(torch.float32) / INT8_MAX).clamp_min(_EPS)


def quantize_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # weight: [N, K], scale: [N] -> q: [N, K] int8
    return torch.round(weight.to(torch.float32) / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_int8(
    qweight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    # qweight: [N, K] int8, scale: [N] -> [N, K] float32 (written into `out` when given)
    if out is not None:
        return out.copy_(qweight).mul_(scale.to(torch.float32)[:, None])
    return qweight.to(torch.float32) * scale.to(torch.float32)[:, None]


def int4_group_params(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max parameters per group: weight [N, K] -> scale [N, K/g] float32, zero_point [N, K/g] uint8."""
    n, k = weight.shape
    groups = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    w_min = groups.amin(dim=2).clamp(max=0.0)
    w_max = groups.amax(dim=2).clamp(min=0.0)
    scale = ((w_max - w_min) / INT4_MAX).clamp_min(_EPS)
    zero_point = torch.round(-w_min / scale).clamp_(0, INT4_MAX).to(torch.uint8)
    return scale, zero_point


def quantize_int4(
    weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int
) -> torch.Tensor:
    # weight: [N, K], scale/zero_point: [N, K/g] -> q: [N, K] uint8 in [0, 15]
    scale_full = scale.to(torch.float32).repeat_interleave(group_size, dim=1)
    zero_full = zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)
    q = torch.round(weight.to(torch.float32) / scale_full) + zero_full
    return q.clamp_(0, INT4_MAX).to(torch.uint8)


def dequantize_int4(
    qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int
) -> torch.Tensor:
    # qweight: [N, K] uint8, scale/zero_point: [N, K/g] -> [N, K] float32
    scale_full = scale.to(torch.float32).repeat_interleave(group_size, dim=1)
    zero_full = zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)
    return (qweight.to(torch.float32) - zero_full) * scale_full


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte along the input dimension: [N, K] uint8 -> [N, K/2] uint8 (low nibble first)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    # packed: [N, K/2] uint8 -> [N, K] uint8
    low = packed & 0xF
    high = (packed >> 4) & 0xF
    return torch.stack([low, high], dim=2).reshape(packed.shape[0], packed.shape[1] * 2)


def int4_cpu_scale_and_zeros(
    scale: torch.Tensor, zero_point: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """torch's int4 CPU/CUDA kernels dequantize as (q - 8) * scale + zero; map our zero point onto that.

    (q - zp) * s = (q - 8) * s + (8 - zp) * s, so zero = (8 - zp) * s exactly.
    scale/zero_point: [N, K/g] -> [K/g, N, 2]
    """
    zero = (8.0 - zero_point.to(torch.float32)) * scale.to(torch.float32)
    return torch.stack([scale.to(torch.float32).t(), zero.t()], dim=2).to(dtype).contiguous()


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token activation quantization: x [M, K] -> q [M, K] int8, scale [M, 1] float32."""
    scale = (x.detach().abs().amax(dim=1, keepdim=True).to(torch.float32) / INT8_MAX).clamp_min(_EPS)
    q = torch.round(x.to(torch.float32) / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def round_rows(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] rounded to integers |q| <= top against its largest magnitude, as the native kernels
    round activations (csrc/linear.h `Act`; top 32767: int16, 127: int8): q = round_half_even(x * (top / peak))
    in float32, scale = peak / top (x ~= q * scale; a zero row is all zeros, scale 0) -> q [M, K] float32 (integer
    valued), scale [M, 1] float32."""
    x = x.to(torch.float32)
    peak = x.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(peak > 0, torch.tensor(float(top)) / peak, torch.zeros_like(peak))
    return torch.round(x * inverse), peak / float(top)


def smoothquant_scale(act_abs_max: torch.Tensor, weight_abs_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant migration s_j = max|X_j|^alpha / max|W_j|^(1 - alpha); X / s and W * s keep X W^T exact.

    act_abs_max, weight_abs_max: [K] -> s: [K]
    """
    act = act_abs_max.to(torch.float32).clamp_min(1e-5)
    wgt = weight_abs_max.to(torch.float32).clamp_min(1e-5)
    return (act.pow(alpha) / wgt.pow(1.0 - alpha)).clamp_min(1e-5)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    noise = (reference.to(torch.float64) - approximation.to(torch.float64)).pow(2).mean()
    signal = reference.to(torch.float64).pow(2).mean()
    return float(10 * torch.log10(signal / noise.clamp_min(1e-30)))


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr(dW H dW^T): squared output error over the calibration inputs. delta [N, K], hessian [K, K]."""
    return ((delta @ hessian) * delta).sum()
