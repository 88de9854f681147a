"""AutoRound (Cheng et al. 2023; Intel's auto-round): learn, per weight, which way it rounds, and per group how far
its range is clipped, by signed gradient descent on a decoder block's output error.

Round-to-nearest minimises each weight's own error; what matters is the block's output on real inputs. AutoRound
adds a rounding offset `v` in [-0.5, 0.5] to every weight before rounding (so a weight may round the other way)
and multiplies each group's minimum and maximum by learned factors in [0, 1] (clipping), then trains them with
the straight-through estimator against the FP32 block's outputs, updating each parameter by `lr * sign(grad)`
(the gradients' magnitudes vary over orders of magnitude between layers; their signs do not) with a learning
rate decaying linearly to zero, and keeps the best step seen.

The grid is the scheme's own (`primitives`): int4 asymmetric per group with an fp16 scale and a uint8 zero point
computed from the fp32 scale exactly as `int4_group_params` does, int8 symmetric per output channel. So with
`v = 0` and factors of 1 the codes are RTN's, and `stored_tensors` returns exactly the tensors whose
dequantized weight `learned_weight` trained with (bit for bit). Starting from GPTQ (`init="gptq"`), the weight whose
rounding is learned is GPTQ's dequantized weight while the range stays the original weight's: the starting codes
are then GPTQ's.

Pure tensor math: the block-by-block walk that supplies the loss is `quantize.sequential.apply`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from quantize.algorithms.settings import AutoRound
from quantize.formats import primitives as P
from quantize.formats.schemes import Int4, Int8, Scheme
from quantize.runtime.handlers import Int4Handler

_EPS = 1e-12
_FP16_TINY = 2.0**-24
OFFSET_LIMIT = 0.5
SCALE_RANGE = (0.0, 1.0)


@dataclass
class Rounding:
    """What AutoRound learns for one linear, and what stays fixed.

    `weight` [N, K]: the weight whose rounding is learned (the original, or GPTQ's result); `low`/`high`
    [N, G]: the range each group's grid spans before clipping (int8: G = 1, `low` unused); `offset` [N, K],
    `min_scale`/`max_scale` [N, G]: the learned parameters; `best`: the stored tensors of the best step so far
    (codes and scales: an eighth of the weight's bytes at int4, where a copy of the parameters is a whole
    weight's)."""

    scheme: Scheme
    weight: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    offset: torch.Tensor
    min_scale: torch.Tensor
    max_scale: torch.Tensor
    best: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return self.scheme.group_size if isinstance(self.scheme, Int4) else int(self.weight.shape[1])

    def parameters(self) -> list[torch.Tensor]:
        return list(self._named().values())

    def keep_best(self) -> None:
        self.best = stored_tensors(self)

    def _named(self) -> dict[str, torch.Tensor]:
        return {"offset": self.offset, "min_scale": self.min_scale, "max_scale": self.max_scale}


def init_rounding(scheme: Scheme, original: torch.Tensor, start: torch.Tensor | None = None) -> Rounding:
    """The zero point of learning for `original` [N, K]: no offset, no clipping; the codes are those of `start`
    (a weight on `original`'s grid, e.g. GPTQ's dequantized result) or RTN's."""
    if not isinstance(scheme, Int8 | Int4):
        raise ValueError(f"AutoRound learns int8 and int4 weights, not {scheme.label()}")
    w = original.detach().to(torch.float32)
    n, k = w.shape
    if isinstance(scheme, Int4):
        groups = w.reshape(n, k // scheme.group_size, scheme.group_size)
        low, high = groups.amin(dim=2).clamp(max=0.0), groups.amax(dim=2).clamp(min=0.0)
    else:
        high = w.abs().amax(dim=1, keepdim=True)
        low = torch.zeros_like(high)
    base = start.detach().to(torch.float32) if start is not None else w  # only read: no copy
    return Rounding(
        scheme=scheme,
        weight=base,
        low=low,
        high=high,
        offset=torch.zeros(n, k, dtype=torch.float32, requires_grad=True),
        min_scale=torch.ones_like(high, requires_grad=True),
        max_scale=torch.ones_like(high, requires_grad=True),
    )


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def _grid(r: Rounding) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per group: the scale computed with (int4: fp16-rounded, straight through) and the zero point (int4 only),
    both as the handler stores them."""
    if isinstance(r.scheme, Int4):
        low = r.low * r.min_scale
        high = r.high * r.max_scale
        scale32 = ((high - low) / P.INT4_MAX).clamp_min(_EPS)
        zero = _round_ste(-low / scale32).clamp(0, P.INT4_MAX)
        scale = scale32 + (scale32.to(torch.float16).to(torch.float32) - scale32).detach()
        return scale, zero
    scale = (r.high * r.max_scale / P.INT8_MAX).clamp_min(_EPS)
    return scale, None


def _bounds(r: Rounding) -> tuple[float, float]:
    return (0.0, float(P.INT4_MAX)) if isinstance(r.scheme, Int4) else (-float(P.INT8_MAX), float(P.INT8_MAX))


def _grouped(r: Rounding, t: torch.Tensor) -> torch.Tensor:
    n, k = r.weight.shape
    return t.reshape(n, k // r.group_size, r.group_size)


def _quantized(
    w: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bounds: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, G, g] codes before and after clamping to `bounds`: round(w / scale + v) (+ zero). A scale that fp16
    rounds to 0 (an all-zero group) divides as the smallest fp16 number: its codes are then finite and
    dequantize to 0."""
    codes = torch.round(w / scale.clamp_min(_FP16_TINY)[..., None] + v)
    if zero is not None:
        codes = codes + zero[..., None]
    return codes, codes.clamp(*bounds)


class _FakeQuant(torch.autograd.Function):
    """The dequantized weight (q - zero) x scale of q = clamp(round(w / scale + v) + zero), straight through the
    rounding. Its backward computes the codes again from the weight and the offsets, where autograd would keep
    every intermediate of the chain: a dozen weight-sized passes and tensors become a few."""

    @staticmethod
    def forward(
        ctx: Any,
        w: torch.Tensor,
        v: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        bounds: tuple[float, float],
    ) -> torch.Tensor:
        ctx.save_for_backward(w, v, scale, zero)
        ctx.bounds = bounds
        _codes, q = _quantized(w, v, scale, zero, bounds)
        return q * scale[..., None] if zero is None else (q - zero[..., None]) * scale[..., None]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w, v, scale, zero = ctx.saved_tensors
        codes, q = _quantized(w, v, scale, zero, ctx.bounds)
        inside = (codes >= ctx.bounds[0]) & (codes <= ctx.bounds[1])
        through = grad * scale[..., None]  # d out / d q
        grad_v = through * inside  # straight through the rounding, not past the clamp
        centered = q if zero is None else q - zero[..., None]
        divisor = scale.clamp_min(_FP16_TINY)
        by_divisor = (grad_v * w).sum(-1) / divisor**2 * (scale >= _FP16_TINY)
        grad_scale = (grad * centered).sum(-1) - by_divisor
        grad_zero = (grad_v - through).sum(-1) if zero is not None else None
        return None, grad_v, grad_scale, grad_zero, None


def learned_weight(r: Rounding) -> torch.Tensor:
    """The weight [N, K] the learned rounding computes with, differentiable in its parameters."""
    scale, zero = _grid(r)
    dequant = _FakeQuant.apply(_grouped(r, r.weight), _grouped(r, r.offset), scale, zero, _bounds(r))
    return dequant.reshape(r.weight.shape)


@torch.no_grad()
def stored_tensors(r: Rounding) -> dict[str, torch.Tensor]:
    """The scheme's stored tensors for the learned rounding; the handler dequantizes them to `learned_weight(r)`."""
    scale, zero = _grid(r)
    _codes, q = _quantized(_grouped(r, r.weight), _grouped(r, r.offset), scale, zero, _bounds(r))
    q = q.reshape(r.weight.shape)
    if zero is None:
        return {"qweight": q.to(torch.int8), "scale": scale[:, 0].contiguous()}
    return Int4Handler.pack(q.to(torch.uint8), scale, zero.to(torch.uint8))


@dataclass
class Learned:
    """How one block's training went: the loss at the start, the best, at which step, and the steps run."""

    initial_loss: float
    best_loss: float
    best_step: int
    steps: int
    losses: list[float]

    def to_info(self) -> dict[str, Any]:
        return {
            "autoround_initial_loss": self.initial_loss,
            "autoround_best_loss": self.best_loss,
            "autoround_best_step": self.best_step,
            "autoround_steps": self.steps,
        }


def best_tensors(r: Rounding) -> dict[str, torch.Tensor]:
    """The stored tensors of the best step `learn_rounding` saw (the current parameters' before any)."""
    return r.best if r.best else stored_tensors(r)


BlockLoss = Callable[[dict[str, torch.Tensor], int], Iterable[torch.Tensor]]


def learn_rounding(roundings: Mapping[str, Rounding], loss: BlockLoss, settings: AutoRound) -> Learned:
    """Train every rounding of one block together: `loss(weights, step)` yields the parts (say, one per packed
    row) of the block's output error with the given fake-quantized weights on step `step`'s batch; their sum is
    the loss. Signed gradient descent, lr decaying linearly to 0, the parameters clamped to their ranges after
    each step; `best_tensors` gives the best step's stored tensors at the end.

    The backward runs in two stages, so a step holds one row's activations and one layer's fake-quantization
    graph at a time instead of every row's and every layer's at once (at Llama-3-8B's widths those graphs are
    several times the block's 0.9 GB): each part is backpropagated as it comes, to the fake-quantized weights
    (plain tensors that collect their gradient), then each layer's fake quantization is computed again and
    backpropagated from that gradient to its parameters.

    Step 0's loss (before any update) is the starting method's; a step only counts as best when its loss is
    lower, so the result is never worse than the start on the batches seen."""
    lr = settings.learning_rate
    best = float("inf")
    best_step = 0
    losses: list[float] = []
    for step in range(settings.iters + 1):
        training = step < settings.iters
        with torch.no_grad():
            weights = {name: learned_weight(r).requires_grad_(training) for name, r in roundings.items()}
        current = 0.0
        for part in loss(weights, step):
            current += float(part.detach())
            if training:
                part.backward()
        losses.append(current)
        if current < best:
            best, best_step = current, step
            for r in roundings.values():
                r.keep_best()
        if not training:
            break
        for name, r in roundings.items():
            for p in r.parameters():
                p.grad = None
            grad = weights.pop(name).grad
            if grad is not None:
                learned_weight(r).backward(grad)
            del grad
        rate = lr * (1.0 - step / settings.iters)
        with torch.no_grad():
            for r in roundings.values():
                _signed_step(r, rate)
    return Learned(losses[0], best, best_step, settings.iters, losses)


def _signed_step(r: Rounding, rate: float) -> None:
    for p in r.parameters():
        if p.grad is not None:
            p.sub_(rate * torch.sign(p.grad))
    r.offset.clamp_(-OFFSET_LIMIT, OFFSET_LIMIT)
    r.min_scale.clamp_(*SCALE_RANGE)
    r.max_scale.clamp_(*SCALE_RANGE)
