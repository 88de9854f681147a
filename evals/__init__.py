"""MMLU drift evaluation and quality gates: an artifact scored against its reference, question by question.

The public names below are imported on first use, so `import evals` stays instant; the `TYPE_CHECKING` block
gives type checkers and editors the same names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from evals.config import EvaluateConfig, Gate
    from evals.mmlu import load_mmlu
    from evals.pipeline import evaluate
    from evals.results import EvaluateResult, Evaluation

_EXPORTS = {
    "EvaluateConfig": "evals.config",
    "EvaluateResult": "evals.results",
    "Evaluation": "evals.results",
    "Gate": "evals.config",
    "evaluate": "evals.pipeline",
    "load_mmlu": "evals.mmlu",
}
__all__ = ["EvaluateConfig", "EvaluateResult", "Evaluation", "Gate", "evaluate", "load_mmlu"]

__getattr__ = lazy_exports("evals", _EXPORTS)
