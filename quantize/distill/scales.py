"""A quantized linear whose scales learn while its integer grid stays fixed: the math of `--distill`.

What the artifact stores for an int4 layer is codes, a zero point and an fp16 scale per group; for an int8 layer
codes and an fp32 scale per output channel. Distillation trains only the scales: each is multiplied by
`exp(log_factor)` (a factor, so one learning rate suits scales of every magnitude, and a scale stays positive),
with the codes and zero points fixed (a zero point is an integer on the grid: a continuous shift of it has no
stored form). The weight the student computes with is exactly what the artifact will dequantize to: the
trained scale is rounded to its stored dtype in the forward pass (straight-through in the backward), so
`stored` writes the tensors the student was measured with.

Pure tensor math, like `quantize.formats.primitives`: the model walk is `quantize.distill.student`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantize.formats import primitives as P
from quantize.formats.schemes import Int4, Int8, Scheme


@dataclass
class LearnedScale:
    """One linear's fixed grid and learnable scales.

    `grid` [N, K]: the integer levels each weight sits on, less its zero point, as float32 (`q - z`, or `q` for
    int8); `scale` [N, G] (int4) or [N] (int8): the stored scale in float32; `log_factor`: the learned parameter,
    shaped like `scale`; `dtype`: the scale's stored dtype."""

    scheme: Scheme
    grid: torch.Tensor
    scale: torch.Tensor
    log_factor: torch.Tensor
    dtype: torch.dtype

    def trained_scale(self) -> torch.Tensor:
        """The scale as the artifact will store it (rounded to its dtype; the gradient passes straight through)."""
        scale = self.scale * torch.exp(self.log_factor)
        return scale + (scale.to(self.dtype).to(torch.float32) - scale).detach()

    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] with the trained scales."""
        scale = self.trained_scale()
        if isinstance(self.scheme, Int4):
            return self.grid * scale.repeat_interleave(self.scheme.group_size, dim=1)
        return self.grid * scale[:, None]

    def stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (the layer's stored form) with the trained scale in place of the original one."""
        return stored_with(tensors, self.log_factor)


def stored_with(tensors: dict[str, torch.Tensor], log_factor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stored int4/int8 layer's tensors with its scale multiplied by `exp(log_factor)`, in the scale's dtype."""
    stored = tensors["scale"]
    with torch.no_grad():
        scale = (stored.to(torch.float32) * torch.exp(log_factor)).to(stored.dtype).contiguous()
    return {**tensors, "scale": scale}


def learnable(scheme: Scheme) -> bool:
    """Whether distillation trains this scheme's scales (weight-only int4 and int8; the others stay as built)."""
    return type(scheme) in (Int4, Int8)


def learned_scale(scheme: Scheme, tensors: dict[str, torch.Tensor]) -> LearnedScale:
    """The learnable form of one stored int4/int8 layer, starting where it is (factor 1: the same weight)."""
    if isinstance(scheme, Int4):
        codes = P.unpack_int4(tensors["qweight"]).to(torch.float32)
        zero = tensors["zero_point"].to(torch.float32).repeat_interleave(scheme.group_size, dim=1)
        grid = codes - zero
    elif isinstance(scheme, Int8):
        grid = tensors["qweight"].to(torch.float32)
    else:
        raise ValueError(f"distillation does not train {scheme.label()} scales")
    stored = tensors["scale"]
    scale = stored.to(torch.float32)
    return LearnedScale(scheme, grid, scale, torch.zeros_like(scale, requires_grad=True), stored.dtype)
