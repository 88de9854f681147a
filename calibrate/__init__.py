"""Calibration on real user queries: read, clean, scrub, sample, and record activation statistics.

Produces the calibration directory described in `quantize.io.calibration`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from calibrate.config import CalibrationConfig, CalibrationResult
    from calibrate.pipeline import run_calibration
    from calibrate.sources import read_source

_EXPORTS = {
    "CalibrationConfig": "calibrate.config",
    "CalibrationResult": "calibrate.config",
    "run_calibration": "calibrate.pipeline",
    "read_source": "calibrate.sources",
}
__all__ = ["CalibrationConfig", "CalibrationResult", "read_source", "run_calibration"]
__getattr__ = lazy_exports("calibrate", _EXPORTS)
