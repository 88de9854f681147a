"""How weights are chosen for a scheme: one module per method, each pure functions of tensors.

A weight `[N, K]`, the Hessian proxy `H = X^T X` of the layer's inputs over the calibration tokens, and per-channel
activation statistics in; stored tensors (or a per-channel scale to fold) out. The block-by-block pass that
collects `H`, folds scales into the model and stores the results is `quantize.sequential.apply`.

- `rtn`: round to nearest (also the fake-quantization the other methods and the sensitivity analysis use).
- `gptq`: error feedback through the inverse Hessian, one column at a time.
- `awq`: activation-aware per-channel scales, searched on the output error.
- `smoothquant`: activation outliers migrated into the weights, for int8 activations.
"""

from __future__ import annotations

from quantize.algorithms.awq import AWQConfig, awq_search
from quantize.algorithms.gptq import GPTQConfig, PreparedHessian, gptq, prepare_hessian
from quantize.algorithms.rtn import fake_quant, rtn
from quantize.algorithms.smoothquant import smoothquant_factor

ALGORITHMS: tuple[str, ...] = ("rtn", "gptq", "awq", "smoothquant")

__all__ = [
    "ALGORITHMS",
    "AWQConfig",
    "GPTQConfig",
    "PreparedHessian",
    "awq_search",
    "fake_quant",
    "gptq",
    "prepare_hessian",
    "rtn",
    "smoothquant_factor",
]
