"""How good is the Fisher estimate of per-layer KL, and what does planning with it cost? Same run, two models.

For each model: exact KL of every decoder linear's most aggressive candidate (`--sensitivity kl`), the Fisher
estimate of the same quantity (raw, no scaling), their Spearman rank correlation and median ratio, the time each
took; then the mixed preset planned with each (`--sensitivity kl` vs `fisher`) and the held-out KL of the two
artifacts. Models: SmolLM2-135M (default calibration) and stories260k (a genuinely FP32 Llama).

    python benchmarks/sensitivity_proxy.py --calibration out/calibration --out out/sensitivity
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def spearman(a: list[float], b: list[float]) -> float:
    import torch

    def ranks(values: list[float]) -> torch.Tensor:
        order = torch.tensor(values).argsort()
        r = torch.empty(len(values), dtype=torch.float64)
        r[order] = torch.arange(len(values), dtype=torch.float64)
        return r - r.mean()

    ra, rb = ranks(a), ranks(b)
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def compare(model_spec: str, calibration: Path) -> dict[str, Any]:
    from quantize.config import QuantizeConfig
    from quantize.io.calibration import CalibrationData
    from quantize.model.sources import load_model, resolve_model
    from quantize.planning.build import _candidates
    from quantize.sensitivity.measure import measure_sensitivity
    from quantize.sensitivity.settings import SensitivityConfig
    from quantize.sequential.streamed import StreamedModel

    source = resolve_model(model_spec)
    model = load_model(source)
    data = CalibrationData.load(calibration)
    schemes = _candidates(QuantizeConfig(output=Path("x"), calibration=calibration, preset="mixed"))
    candidates: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        if ".layers." in name and hasattr(module, "in_features"):
            valid = [s for s in schemes if not s.problems(module.in_features, module.out_features)]
            if valid:
                candidates[name] = valid
    started = time.perf_counter()
    exact, _, _ = measure_sensitivity(
        model, candidates, data.heldout, SensitivityConfig(method="kl"), "proxy-bench"
    )
    exact_s = time.perf_counter() - started
    started = time.perf_counter()
    fisher_config = SensitivityConfig(method="fisher", calibration_layers=0)
    fisher, _, _ = measure_sensitivity(
        model, candidates, data.heldout, fisher_config, "proxy-bench", streamed=StreamedModel(source.path)
    )
    fisher_s = time.perf_counter() - started
    kl, estimate = [], []
    for name, valid in candidates.items():
        aggressive = min(valid, key=lambda s: s.bits_per_weight(*_shape(model, name)))
        value, how = exact.value(name, aggressive)
        if how == "measured":
            kl.append(value)
            estimate.append(fisher.value(name, aggressive)[0])
    ratios = sorted(e / k for e, k in zip(estimate, kl, strict=True) if k > 0)
    return {
        "model": source.model_id,
        "layers": len(kl),
        "spearman": round(spearman(estimate, kl), 4),
        "median_ratio_fisher_to_exact": round(ratios[len(ratios) // 2], 4),
        "exact_kl_s": round(exact_s, 1),
        "fisher_s": round(fisher_s, 1),
    }


def _shape(model: Any, name: str) -> tuple[int, int]:
    module = model.get_submodule(name)
    return int(module.in_features), int(module.out_features)


def plans(calibration: Path, out: Path) -> dict[str, Any]:
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model
    from quantize.sensitivity.settings import SensitivityConfig

    results = {}
    for method in ("kl", "fisher"):
        started = time.perf_counter()
        config = QuantizeConfig(
            output=out / f"mixed-{method}",
            calibration=calibration,
            preset="mixed",
            sensitivity=SensitivityConfig(method=method),
            overwrite=True,
        )
        manifest = quantize_model(config).manifest
        results[method] = {
            "seconds": round(time.perf_counter() - started, 1),
            "plan_seconds": manifest["timings_s"]["plan"],
            "predicted_kl": manifest["quality"]["predicted_kl"],
            "measured_kl": manifest["quality"]["kl"],
            "top1": manifest["quality"]["top1_agreement"],
            "avg_bits": manifest["size"]["avg_bits_quantized"],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibration", type=Path, required=True, help="SmolLM2 calibration directory")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "sensitivity")
    args = parser.parse_args()
    import shutil

    from tests.conftest import STORIES, calibrate_for

    args.out.mkdir(parents=True, exist_ok=True)
    calibration = (
        args.out / "smollm2-cal"
    )  # a copy without a sensitivity cache, so each method is timed fresh
    shutil.rmtree(calibration, ignore_errors=True)
    shutil.copytree(args.calibration, calibration)
    (calibration / "sensitivity.json").unlink(missing_ok=True)
    stories_cal = args.out / "stories-cal"
    if not (stories_cal / "manifest.json").is_file():
        calibrate_for(STORIES, stories_cal, n=160)
    results = {
        "smollm2": compare("smollm2-135m", calibration),
        "stories260k": compare(str(STORIES), stories_cal),
        "plans_smollm2_mixed": plans(calibration, args.out),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
