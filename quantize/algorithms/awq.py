"""AWQ (Lin et al. 2023): per-input-channel scales `s = rms(x)^alpha` that protect salient channels.

Channels with large activations are scaled up before rounding and down after (the scale is folded into the
module in front of the group, so the product is unchanged); the best alpha on a grid minimises the group's
output error `tr(dW H dW^T)` on the calibration Hessian. alpha = 0 (no scaling) is on the grid, so AWQ never does
worse than RTN on that objective."""

from __future__ import annotations

import math

import torch

from quantize.algorithms.rtn import fake_quant
from quantize.algorithms.settings import AWQ
from quantize.formats.primitives import output_error
from quantize.formats.schemes import Scheme


def awq_search(
    weights: list[torch.Tensor],
    schemes: list[Scheme | None],
    hessian: torch.Tensor,
    act_rms: torch.Tensor,
    config: AWQ = AWQ(),
) -> tuple[torch.Tensor, float]:
    """Best per-input-channel scale for a group of linears sharing one input.

    weights: list of [N_i, K]; schemes: each member's scheme (None = kept FP, ignored); hessian: [K, K];
    act_rms: [K] -> (s [K], alpha). alpha = 0 (s = 1) is always in the grid, so AWQ never does worse than RTN
    on the calibration objective.
    """
    members = [(w.to(torch.float32), s) for w, s in zip(weights, schemes, strict=True) if s is not None]
    if not members:
        return torch.ones_like(act_rms, dtype=torch.float32), 0.0
    rms = act_rms.to(torch.float32).clamp_min(1e-6)
    best_error, best_alpha = math.inf, 0.0
    best_scale = torch.ones_like(rms)
    for step in range(config.grid + 1):
        alpha = step / config.grid
        s = rms.pow(alpha)
        s = s / torch.sqrt(s.max() * s.min())
        error = torch.zeros((), dtype=torch.float64)
        for w, scheme in members:
            delta = fake_quant(scheme, w * s[None, :]) / s[None, :] - w
            error += output_error(delta, hessian).to(torch.float64)
        if float(error) < best_error:
            best_error, best_alpha, best_scale = float(error), alpha, s
    return best_scale, best_alpha
