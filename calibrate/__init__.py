"""Calibration on real user queries: read, clean, scrub, sample, and record activation statistics.

Produces the calibration directory described in `quantize.calibdata`.
"""

from __future__ import annotations

from calibrate.pipeline import CalibrationConfig, CalibrationResult, run_calibration

__all__ = ["CalibrationConfig", "CalibrationResult", "run_calibration"]
