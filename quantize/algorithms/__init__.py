"""How weights are chosen for a scheme: the methods' settings as data (`settings`, importable without torch) and
one module per method's math, each pure functions of tensors.

A weight `[N, K]`, the Hessian proxy `H = X^T X` of the layer's inputs over the calibration tokens, and per-channel
activation statistics in; stored tensors (or a per-channel scale to fold) out. The block-by-block pass that
collects `H`, folds scales into the model and stores the results is `quantize.sequential.apply`.

- `rtn`: round to nearest (also the fake-quantization the other methods and the sensitivity analysis use).
- `gptq`: error feedback through the inverse Hessian, one column at a time.
- `awq`: activation-aware per-channel scales, searched on the output error.
- `smoothquant`: activation outliers migrated into the weights, for int8 activations.
- `autoround`: rounding offsets and clipping learned by signed gradient descent on a block's output error.

The settings classes are imported here directly; the math functions on first use, so importing this package (as
every config does) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.algorithms.settings import (
    ALGORITHMS,
    AWQ,
    GPTQ,
    RTN,
    Algorithm,
    Auto,
    AutoRound,
    SmoothQuant,
    algorithm_for,
)
from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from quantize.algorithms.autoround import (
        Rounding,
        best_tensors,
        init_rounding,
        learn_rounding,
        learned_weight,
        stored_tensors,
    )
    from quantize.algorithms.awq import awq_search
    from quantize.algorithms.gptq import PreparedHessian, prepare_hessian, quantize_gptq
    from quantize.algorithms.rtn import fake_quant, quantize_rtn
    from quantize.algorithms.smoothquant import smoothquant_factor

__all__ = [
    "ALGORITHMS",
    "AWQ",
    "GPTQ",
    "RTN",
    "Algorithm",
    "Auto",
    "AutoRound",
    "PreparedHessian",
    "Rounding",
    "SmoothQuant",
    "algorithm_for",
    "awq_search",
    "best_tensors",
    "fake_quant",
    "init_rounding",
    "learn_rounding",
    "learned_weight",
    "prepare_hessian",
    "quantize_gptq",
    "quantize_rtn",
    "smoothquant_factor",
    "stored_tensors",
]

__getattr__ = lazy_exports(
    "quantize.algorithms",
    {
        "awq_search": "quantize.algorithms.awq",
        "Rounding": "quantize.algorithms.autoround",
        "best_tensors": "quantize.algorithms.autoround",
        "init_rounding": "quantize.algorithms.autoround",
        "learn_rounding": "quantize.algorithms.autoround",
        "learned_weight": "quantize.algorithms.autoround",
        "stored_tensors": "quantize.algorithms.autoround",
        "PreparedHessian": "quantize.algorithms.gptq",
        "quantize_gptq": "quantize.algorithms.gptq",
        "prepare_hessian": "quantize.algorithms.gptq",
        "fake_quant": "quantize.algorithms.rtn",
        "quantize_rtn": "quantize.algorithms.rtn",
        "smoothquant_factor": "quantize.algorithms.smoothquant",
    },
)
