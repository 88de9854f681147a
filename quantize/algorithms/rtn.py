"""Round-to-nearest: each weight onto the nearest point of its scheme's grid, by the scheme's handler.

The baseline every other method is measured against, the method for schemes no other method supports (bf16,
bitsandbytes), and, as `fake_quant`, the weight a scheme would compute with: what AWQ's search, the sensitivity
analysis and the Fisher estimate perturb a layer by."""

from __future__ import annotations

import torch

from quantize.formats.schemes import Scheme
from quantize.runtime.handlers import handler_for


def quantize_rtn(scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [N, K] float -> `scheme`'s stored tensors, each weight rounded to the nearest grid point."""
    return handler_for(scheme).quantize(scheme, weight)


def fake_quant(scheme: Scheme, weight: torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize with RTN: the weight the scheme would actually compute with."""
    handler = handler_for(scheme)
    return handler.dequantize(scheme, handler.quantize(scheme, weight))
