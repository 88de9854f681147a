"""SmoothQuant (Xiao et al. 2022): migrate activation outliers into the weights before int8 activations.

`s = max|x|^a / max|w|^(1-a)` per input channel over a group of linears sharing one input: x / s and W * s keep
the product exact while the activations the per-token int8 quantizer sees lose their outlier channels."""

from __future__ import annotations

import torch

from quantize.formats import primitives as P


def smoothquant_factor(weights: list[torch.Tensor], act_abs_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant factor for a group of linears sharing one input: weights list of [N_i, K] -> s [K]."""
    weight_abs_max = torch.stack([w.detach().abs().amax(dim=0) for w in weights]).amax(dim=0)
    return P.smoothquant_scale(act_abs_max, weight_abs_max, alpha)
