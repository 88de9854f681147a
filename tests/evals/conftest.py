"""The artifact every evaluation test scores: tiny Llama, int4 (group 32) by round to nearest, in seconds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from quantize.algorithms import RTN
from quantize.config import QuantizeConfig
from quantize.formats.schemes import Int4
from quantize.pipeline import quantize_model
from quantize.planning.presets import PRESETS
from quantize.sensitivity.settings import SensitivityConfig

FAST = dict(algorithm=RTN(), sensitivity=SensitivityConfig(num_tokens=64), calib_tokens=256, eval_tokens=128)


def quantized(calibration: Path, out: Path, preset: str) -> Path:
    schemes = (Int4(32),) if preset == "int4" else ()
    quantize_model(
        QuantizeConfig(output=out, calibration=calibration, preset=PRESETS[preset], schemes=schemes, **FAST)
    )
    return out


@pytest.fixture()
def make_artifact(tiny_llama_calibration: Path, tmp_path: Path) -> Callable[[str, str], Path]:
    """make_artifact(name, preset): a tiny Llama artifact at tmp_path/name."""
    return lambda name, preset: quantized(tiny_llama_calibration, tmp_path / name, preset)


@pytest.fixture()
def artifact(make_artifact: Callable[[str, str], Path]) -> Path:
    return make_artifact("art", "int4")
