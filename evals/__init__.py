"""MMLU drift evaluation and quality gates: an artifact scored against its reference, question by question."""

from __future__ import annotations

from quantize.common.lazy import lazy_exports

_EXPORTS = {
    "EvaluateConfig": "evals.evaluate",
    "EvaluateResult": "evals.evaluate",
    "Gate": "evals.evaluate",
    "evaluate": "evals.evaluate",
    "load_mmlu": "evals.mmlu",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports("evals", _EXPORTS)
