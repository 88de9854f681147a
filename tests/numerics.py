"""What the tests hold each numeric path to: error bounds derived from the path's own rounding, not from the CPU.

A test names the path it checks (prefill dtype, kernel build, native kernels on or off) and takes its tolerance
from here, so the same test passes on an AVX2-only, an AVX-512+BF16 or an AMX machine and fails on all of them
when a path computes something else.
"""

from __future__ import annotations

import torch

# Unit roundoff: half the spacing of numbers near 1 (bfloat16 keeps 8 significant bits, float32 24).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def gemm_error_bound(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |x @ weight.T computed in `dtype` - the exact product| per output [M, N]: inputs rounded to
    `dtype` (relative error u each), float32 accumulation over K terms, the result rounded to `dtype`."""
    u = UNIT_ROUNDOFF[dtype]
    magnitude = x.double().abs() @ weight.double().abs().t()  # sum_k |x_k| |w_k|
    exact = (x.double() @ weight.double().t()).abs()
    k = x.shape[-1]
    return magnitude * (2 * u + u * u + k * UNIT_ROUNDOFF[torch.float32]) + exact * u + 1e-6


def int16_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Bound on the error of the native kernels' int8/int4 rows: x rounded to int16 per row (each |x| off by at
    most max|x| / 65534), exact integer sums: sum_k |w_k| * max|x| / 65534 [M, N]."""
    step = x.double().abs().amax(1, keepdim=True) / 65534
    return step * weight.double().abs().sum(1)[None, :] + 1e-4
