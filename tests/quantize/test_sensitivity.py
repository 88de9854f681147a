from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from quantize.calibdata import CalibrationData
from quantize.layerwise import LayerwiseModel, kl_to_reference, make_packs, reference_logits, sample_sequences
from quantize.models import load_model, resolve_model
from quantize.schemes import BF16, Int4, Int8
from quantize.sensitivity import SensitivityConfig, _runtime, measure_sensitivity

LAYER = "model.layers.2.mlp.down_proj"
OTHER = "model.layers.0.self_attn.v_proj"


def test_measured_kl_equals_full_model_kl(
    stories_dir: Path, stories_calibration: Path, tmp_path: Path
) -> None:
    model = load_model(resolve_model(str(stories_dir)))
    data = CalibrationData.load(stories_calibration)
    config = SensitivityConfig(num_tokens=200)
    candidates = {OTHER: [Int4(32), Int8()], "model.layers.1.self_attn.q_proj": [Int4(32), Int8()]}
    table, hits = measure_sensitivity(
        model, candidates, data.heldout, config, "sha", calibration_dir=tmp_path
    )
    assert hits == 0

    # brute force: quantize the layer in a copy of the model and compare whole forwards
    packs = make_packs(sample_sequences(data.heldout, 200, 0, truncate=True), 512, share_prefix=True)
    quantized = copy.deepcopy(model)
    quantized.model.layers[0].self_attn.v_proj = _runtime(Int4(32), model.model.layers[0].self_attn.v_proj)
    ref_lw, q_lw = LayerwiseModel(model), LayerwiseModel(quantized)
    total = count = 0.0
    for pack in packs:
        reference = reference_logits(model.lm_head, ref_lw.final_hidden(pack)[0])
        kl = kl_to_reference(model.lm_head, reference, q_lw.final_hidden(pack)[0])
        total += float((kl * pack.weights).sum())
        count += pack.represented_tokens
    measured, how = table.value(OTHER, Int4(32))
    assert how == "measured"
    assert abs(measured - total / count) <= 1e-3 * total / count

    derived, how = table.value(OTHER, Int8())
    assert how == "derived" and 0 < derived < measured / 5

    # second call: everything from the cache in the calibration dir
    again, hits = measure_sensitivity(
        model, candidates, data.heldout, config, "sha", calibration_dir=tmp_path
    )
    assert hits == 4 and again.value(OTHER, Int4(32)) == table.value(OTHER, Int4(32))
    assert "tokens=200" in next(iter(json.loads((tmp_path / "sensitivity.json").read_text())["entries"]))


def test_kl_all_and_mse_methods(stories_dir: Path, stories_calibration: Path) -> None:
    model = load_model(resolve_model(str(stories_dir)))
    data = CalibrationData.load(stories_calibration)
    candidates = {LAYER: [Int8(), BF16()]}
    full, _ = measure_sensitivity(
        model, candidates, data.heldout, SensitivityConfig(method="kl-all", num_tokens=64), "x"
    )
    assert full.value(LAYER, BF16())[1] == "measured" and full.value(LAYER, Int8())[1] == "measured"
    assert full.value(LAYER, BF16())[0] < full.value(LAYER, Int8())[0]
    mse, _ = measure_sensitivity(
        model, candidates, data.heldout, SensitivityConfig(method="mse", num_tokens=64), "x"
    )
    value, how = mse.value(LAYER, Int8())
    assert how == "mse" and 0 < value < 1e-2
    assert torch.isfinite(torch.tensor(value))
