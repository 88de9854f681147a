from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from quantize.formats.schemes import BF16, Int4, Int8
from quantize.io.calibration import CalibrationData
from quantize.model.sources import load_model, resolve_model
from quantize.sensitivity.exact import _runtime, kl_to_reference, reference_logits
from quantize.sensitivity.measure import measure_sensitivity
from quantize.sensitivity.settings import SensitivityConfig
from quantize.sequential.packing import make_packs, sample_sequences
from quantize.sequential.runner import BlockRunner

LAYER = "model.layers.2.mlp.down_proj"
OTHER = "model.layers.0.self_attn.v_proj"


def test_measured_kl_equals_full_model_kl(
    stories_dir: Path, stories_calibration: Path, tmp_path: Path
) -> None:
    model = load_model(resolve_model(str(stories_dir)))
    data = CalibrationData.load(stories_calibration)
    config = SensitivityConfig(method="kl", num_tokens=200)
    candidates = {OTHER: [Int4(32), Int8()], "model.layers.1.self_attn.q_proj": [Int4(32), Int8()]}
    table, hits, _ = measure_sensitivity(
        model, candidates, data.heldout, config, "sha", calibration_dir=tmp_path
    )
    assert hits == 0

    # brute force: quantize the layer in a copy of the model and compare whole forwards
    packs = make_packs(sample_sequences(data.heldout, 200, 0, truncate=True), 512, share_prefix=True)
    quantized = copy.deepcopy(model)
    quantized.model.layers[0].self_attn.v_proj = _runtime(Int4(32), model.model.layers[0].self_attn.v_proj)
    ref_lw, q_lw = BlockRunner(model), BlockRunner(quantized)
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
    again, hits, _ = measure_sensitivity(
        model, candidates, data.heldout, config, "sha", calibration_dir=tmp_path
    )
    assert hits == 4 and again.value(OTHER, Int4(32)) == table.value(OTHER, Int4(32))
    assert "tokens=200" in next(iter(json.loads((tmp_path / "sensitivity.json").read_text())["entries"]))


def test_kl_all_and_mse_methods(stories_dir: Path, stories_calibration: Path) -> None:
    model = load_model(resolve_model(str(stories_dir)))
    data = CalibrationData.load(stories_calibration)
    candidates = {LAYER: [Int8(), BF16()]}
    full, _, _ = measure_sensitivity(
        model, candidates, data.heldout, SensitivityConfig(method="kl-all", num_tokens=64), "x"
    )
    assert full.value(LAYER, BF16())[1] == "measured" and full.value(LAYER, Int8())[1] == "measured"
    assert full.value(LAYER, BF16())[0] < full.value(LAYER, Int8())[0]
    mse, _, _ = measure_sensitivity(
        model, candidates, data.heldout, SensitivityConfig(method="mse", num_tokens=64), "x"
    )
    value, how = mse.value(LAYER, Int8())
    assert how == "mse" and 0 < value < 1e-2
    assert torch.isfinite(torch.tensor(value))


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> torch.Tensor:
        order = torch.tensor(x).argsort()
        r = torch.empty(len(x))
        r[order] = torch.arange(len(x), dtype=torch.float32)
        return r - r.mean()

    ra, rb = ranks(a), ranks(b)
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def test_the_fisher_estimate_tracks_exact_kl_and_streams(
    stories_dir: Path, stories_calibration: Path
) -> None:
    """On a genuinely FP32 model, the second-order Fisher estimate of each layer's KL against the exact KL
    (an independent answer: each layer quantized alone, the tail re-run); streamed, each block is read twice."""
    from quantize.sequential.streamed import StreamedModel

    model = load_model(resolve_model(str(stories_dir)))
    data = CalibrationData.load(stories_calibration)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    names = [n for n, m in linears.items() if not Int4(32).problems(m.in_features, m.out_features)]
    candidates = {n: [Int4(32)] for n in names}
    exact, _, _ = measure_sensitivity(
        model, candidates, data.heldout, SensitivityConfig(method="kl", num_tokens=256), "x"
    )
    config = SensitivityConfig(method="fisher", num_tokens=256, calibration_layers=0, fisher_samples=8)
    streamed = StreamedModel(stories_dir)
    fisher, _, choice = measure_sensitivity(model, candidates, data.heldout, config, "x", streamed=streamed)
    assert choice["method"] == "fisher" and streamed.peak_blocks == 1
    assert streamed.loads == 2 * streamed.num_layers  # forward, then backward: each block read twice
    kl = [exact.value(n, Int4(32))[0] for n in names]
    estimate = [fisher.value(n, Int4(32))[0] for n in names]
    assert all(fisher.value(n, Int4(32))[1] == "fisher" for n in names)
    assert _spearman(estimate, kl) > 0.7
    ratios = sorted(e / k for e, k in zip(estimate, kl, strict=True))
    assert 0.5 < ratios[len(ratios) // 2] < 2.0  # the same quantity, not just the same order
    loaded, _, _ = measure_sensitivity(model, candidates, data.heldout, config, "x")  # the model in memory
    for name in names:
        assert loaded.value(name, Int4(32))[0] == pytest.approx(fisher.value(name, Int4(32))[0], rel=1e-3)


def test_auto_picks_exact_kl_when_it_fits_the_budget_and_fisher_when_not(stories_dir: Path) -> None:
    from quantize.sensitivity.measure import choose_method

    model = load_model(resolve_model(str(stories_dir)))
    candidates = {
        n: [Int4(32)] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    }
    assert choose_method(model, candidates, SensitivityConfig(), None)["method"] == "kl"
    tight = SensitivityConfig(budget_minutes=1e-9)
    assert choose_method(model, candidates, tight, None)["method"] == "fisher"
    assert choose_method(model, candidates, SensitivityConfig(), max_memory=1000)["method"] == "fisher"
