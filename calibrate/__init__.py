"""Calibration on real user queries: read, clean, scrub, sample, and record activation statistics.

Produces the calibration directory described in `quantize.io.calibration`.
"""

from __future__ import annotations

from quantize.common.lazy import lazy_exports

_EXPORTS = {
    "CalibrationConfig": "calibrate.pipeline",
    "CalibrationResult": "calibrate.pipeline",
    "run_calibration": "calibrate.pipeline",
    "read_source": "calibrate.sources",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports("calibrate", _EXPORTS)
