"""How weights are chosen for a scheme: RTN, GPTQ, AWQ scale search, SmoothQuant migration.

Pure functions of tensors: a weight `[N, K]`, the Hessian proxy `H = X^T X` of the layer's inputs over the
calibration tokens, and per-channel activation statistics. The layer-by-layer driver in `quantize.pipeline`
collects `H`, applies scale folding to the model, and stores what these functions return.

- RTN rounds each weight to the nearest grid point.
- GPTQ (Frantar et al. 2022) quantizes one input column at a time and pushes each column's rounding error
  onto the columns not yet quantized, weighted by the inverse Hessian, so the layer *output* error over the
  calibration inputs is minimised rather than the weight error. Damping, block size and act-order as in the
  reference implementation; groups are kept contiguous in the original column order (static groups), so
  act-order never changes the stored format.
- AWQ (Lin et al. 2023) searches per-input-channel scales `s = rms(x)^alpha` over a grid of alpha: salient
  channels (large activations) get scaled up before rounding and down after, which protects them; the best
  alpha minimises the layers' output error `tr(dW H dW^T)` on the calibration Hessian.
- SmoothQuant (Xiao et al. 2022) migrates activation outliers into the weights, `s = max|x|^a / max|w|^(1-a)`,
  so per-token int8 activations lose less.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantize import primitives as P
from quantize.errors import QpackError
from quantize.handlers import Int4Handler, handler_for
from quantize.schemes import W8A8, Int4, Int8, Scheme

ALGORITHMS: tuple[str, ...] = ("rtn", "gptq", "awq", "smoothquant")


@dataclass(frozen=True)
class GPTQConfig:
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True


@dataclass(frozen=True)
class AWQConfig:
    grid: int = 20


def rtn(scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return handler_for(scheme).quantize(scheme, weight)


def fake_quant(scheme: Scheme, weight: torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize with RTN: the weight the scheme would actually compute with."""
    handler = handler_for(scheme)
    return handler.dequantize(scheme, handler.quantize(scheme, weight))


def _inverse_hessian_cholesky(build: Callable[[], torch.Tensor], damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, H = `build()` (a fresh matrix each call): fp32,
    then fp64 with more damping as fallbacks.

    Computed in place in the built matrix (Cholesky, inverse, Cholesky again), so a K x K problem holds that
    matrix and LAPACK's scratch: at K = 14336 (Llama-3-8B's down_proj) 0.8 GB each."""
    info = torch.empty((), dtype=torch.int32)
    for attempt, dtype in enumerate(
        (torch.float32, torch.float64, torch.float64, torch.float64, torch.float64)
    ):
        work = build().to(dtype)
        k = work.shape[0]
        mean_diag = float(torch.diag(work).mean())
        work.diagonal().add_(damp * (10 ** max(attempt - 1, 0)) * max(mean_diag, 1e-8))
        torch.linalg.cholesky_ex(work, out=(work, info))
        if int(info) == 0:
            torch.cholesky_inverse(work, out=work)
            torch.linalg.cholesky_ex(work, upper=True, out=(work, info))
            if int(info) == 0 and bool(torch.isfinite(work).all()):
                return work.triu_().to(torch.float32)
        del work
    raise QpackError(
        f"GPTQ: the calibration Hessian ({k}x{k}) is singular even with damping; add calibration data"
    )


@dataclass
class PreparedHessian:
    """Per input group, shared by every linear reading that input: column order, dead columns, H^-1 factor."""

    perm: torch.Tensor  # [K] column processing order
    dead: torch.Tensor  # [K] bool, channels that never fire
    h_inv: torch.Tensor  # [K, K] upper Cholesky of the damped inverse, in `perm` order


def prepare_hessian(hessian: torch.Tensor, config: GPTQConfig = GPTQConfig()) -> PreparedHessian:
    diagonal = torch.diag(hessian).to(torch.float32)
    dead = diagonal == 0
    k = hessian.shape[0]
    perm = torch.argsort(diagonal, descending=True) if config.act_order else torch.arange(k)
    dead_perm = dead[perm]

    def permuted() -> torch.Tensor:  # a fresh K x K copy in processing order, dead channels set to 1
        h = hessian.detach().to(torch.float32)[perm[:, None], perm[None, :]]
        h[dead_perm, dead_perm] = 1.0
        return h

    return PreparedHessian(perm=perm, dead=dead, h_inv=_inverse_hessian_cholesky(permuted, config.damp))


def _quantize_columns(
    w_block: torch.Tensor,
    h_inv_block: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    groups: torch.Tensor,
    qmin: float,
    qmax: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's inner loop over one block of columns (updates `w_block` in place).

    w_block [N, B], h_inv_block [B, B] (upper Cholesky of H^-1), scale/zero [N, G], groups [B] -> codes, errors
    """
    cols = w_block.shape[1]
    codes = torch.empty_like(w_block)
    errors = torch.empty_like(w_block)
    for i in range(cols):
        column = w_block[:, i]
        g = int(groups[i])
        s = scale[:, g]
        if zero is None:
            code = torch.clamp(torch.round(column / s), qmin, qmax)
            dequant = code * s
        else:
            z = zero[:, g]
            code = torch.clamp(torch.round(column / s) + z, qmin, qmax)
            dequant = (code - z) * s
        codes[:, i] = code
        err = (column - dequant) / h_inv_block[i, i]
        w_block[:, i:] -= err.unsqueeze(1) * h_inv_block[i, i:].unsqueeze(0)
        errors[:, i] = err
    return codes, errors


try:  # TorchScript runs the per-column loop ~3x faster than the Python interpreter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _quantize_columns_fast = torch.jit.script(_quantize_columns)
except Exception:  # pragma: no cover - scripting unavailable in this torch build
    _quantize_columns_fast = _quantize_columns


def gptq(
    scheme: Scheme,
    weight: torch.Tensor,
    hessian: torch.Tensor | PreparedHessian,
    config: GPTQConfig = GPTQConfig(),
) -> dict[str, torch.Tensor]:
    """GPTQ for int8 (per-channel) and int4 (per-group) weights.

    weight: [N, K] float, hessian: [K, K] = sum of x x^T over calibration tokens (or its `prepare_hessian`)
    -> stored tensors of `scheme`.
    """
    if not isinstance(scheme, Int8 | Int4 | W8A8):
        return rtn(scheme, weight)
    prepared = hessian if isinstance(hessian, PreparedHessian) else prepare_hessian(hessian, config)
    w = weight.detach().to(torch.float32).clone()
    n, k = w.shape
    w[:, prepared.dead] = 0.0
    if isinstance(scheme, Int4):
        group_size = scheme.group_size
        scale, zero_point = P.int4_group_params(w, group_size)  # static groups from the original weights
        scale = scale.to(torch.float16).to(torch.float32)
        zero: torch.Tensor | None = zero_point.to(torch.float32)
        qmin, qmax = 0.0, float(P.INT4_MAX)
    else:
        group_size = k
        scale = P.int8_channel_scale(w)[:, None]  # [N, 1]
        zero = None
        qmin, qmax = -float(P.INT8_MAX), float(P.INT8_MAX)
    perm, h_inv = prepared.perm, prepared.h_inv
    w = w[:, perm]
    group_of = perm // group_size  # original group of each permuted column
    q = torch.zeros(n, k, dtype=torch.float32)
    for start in range(0, k, config.block_size):
        end = min(start + config.block_size, k)
        w_block = w[:, start:end].clone()
        codes, err_block = _quantize_columns_fast(
            w_block, h_inv[start:end, start:end].contiguous(), scale, zero, group_of[start:end], qmin, qmax
        )
        q[:, start:end] = codes
        w[:, end:] -= err_block @ h_inv[start:end, end:]
    q = q[:, torch.argsort(perm)]
    if isinstance(scheme, Int4):
        assert zero is not None
        return Int4Handler.pack(q.to(torch.uint8), scale, zero.to(torch.uint8))
    return {"qweight": q.to(torch.int8), "scale": scale[:, 0].contiguous()}


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr(dW H dW^T): squared output error over the calibration inputs. delta [N, K], hessian [K, K]."""
    return ((delta @ hessian) * delta).sum()


def awq_search(
    weights: list[torch.Tensor],
    schemes: list[Scheme | None],
    hessian: torch.Tensor,
    act_rms: torch.Tensor,
    config: AWQConfig = AWQConfig(),
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


def smoothquant_factor(weights: list[torch.Tensor], act_abs_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant factor for a group of linears sharing one input: weights list of [N_i, K] -> s [K]."""
    weight_abs_max = torch.stack([w.detach().abs().amax(dim=0) for w in weights]).amax(dim=0)
    return P.smoothquant_scale(act_abs_max, weight_abs_max, alpha)
