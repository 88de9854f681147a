"""`qpack build`: calibrate -> quantize -> evaluate with a gate, as one step of a CI model-build pipeline.

Each stage is the same library call the individual commands make, so a build is reproducible command by
command. The calibration directory is kept beside the artifact (`ARTIFACT.calibration`) because the artifact
manifest points at it for held-out checks and the sensitivity cache lives there, so rebuilding with another
budget skips the expensive part. The result is one JSON summary; the exit code is the gate's. The
config and result types import no torch (the command line builds its options from them); the stages are imported
when a build runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.config import CalibrationConfig, CalibrationResult
from evals.config import EvaluateConfig
from evals.results import EvaluateResult
from quantize.common.config import Problems, json_value
from quantize.common.fileio import check_output_dir
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.config import QuantizeConfig, QuantizeResult


@dataclass(frozen=True)
class BuildConfig:
    """One CI build: the calibration directory (built first unless it exists), the quantization, the evaluation.

    The three stages are the configs the individual commands take; they are linked by their paths: the
    calibration writes `quantize.calibration`, and the evaluation reads `quantize.output`.
    """

    quantize: QuantizeConfig
    """How to quantize; `quantize.output` is the artifact, `quantize.calibration` the calibration directory."""
    calibration: CalibrationConfig | None = None
    """How to build the calibration directory when it does not exist yet (default: the defaults for
    `quantize.model`); its output must be `quantize.calibration`."""
    evaluate: EvaluateConfig | None = None
    """How to evaluate the artifact (default: 5 MMLU questions per subject, no gate); its artifact must be
    `quantize.output`."""

    def calibration_config(self) -> CalibrationConfig:
        return self.calibration or CalibrationConfig(
            output=self.quantize.calibration, model=self.quantize.model, overwrite=self.quantize.overwrite
        )

    def evaluate_config(self) -> EvaluateConfig:
        return self.evaluate or EvaluateConfig(
            artifact=self.quantize.output, calibration=self.quantize.calibration, limit=5
        )

    def validate(self) -> None:
        """Every problem of the three stages at once (ConfigError, fields under `calibration.`, `quantize.`,
        `evaluate.`), before calibrating and quantizing, which take minutes."""
        problems = Problems()
        problems.nested("quantize", self.quantize.validate)
        problems.nested("calibration", self.calibration_config().validate)
        problems.nested("evaluate", self.evaluate_config().validate)
        same = Path(self.calibration_config().output).expanduser().resolve()
        problems.check(
            same == Path(self.quantize.calibration).expanduser().resolve(),
            "calibration.output",
            "must be `quantize.calibration`",
        )
        artifact = Path(self.evaluate_config().artifact).expanduser().resolve()
        problems.check(
            artifact == Path(self.quantize.output).expanduser().resolve(),
            "evaluate.artifact",
            "must be `quantize.output`",
        )
        problems.raise_if_any(self)


@dataclass
class BuildResult:
    """What a build made: the calibration directory (None when it existed), the artifact, its evaluation."""

    calibrated: CalibrationResult | None
    quantized: QuantizeResult
    evaluated: EvaluateResult
    stages_s: dict[str, float]
    seconds: float

    @property
    def passed(self) -> bool:
        return self.evaluated.passed

    def to_json(self) -> dict[str, Any]:
        """The one JSON document a CI step reads: where things are, size, quality, MMLU drift, the gate."""
        summary = _summary(self.quantized, self.evaluated)
        summary["stages_s"] = {k: round(v, 1) for k, v in self.stages_s.items()}
        summary["seconds"] = round(self.seconds, 1)
        return summary


def run_build(config: BuildConfig, progress: Progress = NULL_PROGRESS) -> BuildResult:
    from calibrate.pipeline import run_calibration
    from evals.pipeline import evaluate
    from quantize.pipeline import quantize_model

    started = time.perf_counter()
    config.validate()
    output = Path(config.quantize.output).expanduser().resolve()
    check_output_dir(output, config.quantize.overwrite, "artifact directory")
    stages: dict[str, float] = {}
    calibrated = None
    calibration = config.calibration_config()
    if not (Path(calibration.output).expanduser() / "manifest.json").is_file():
        phase = time.perf_counter()
        calibrated = run_calibration(calibration, progress)
        stages["calibrate"] = time.perf_counter() - phase
    phase = time.perf_counter()
    quantized = quantize_model(config.quantize, progress)
    stages["quantize"] = time.perf_counter() - phase
    phase = time.perf_counter()
    evaluated = evaluate(config.evaluate_config(), progress)
    stages["evaluate"] = time.perf_counter() - phase
    return BuildResult(calibrated, quantized, evaluated, stages, time.perf_counter() - started)


def _summary(quantized: QuantizeResult, evaluated: EvaluateResult) -> dict[str, Any]:
    manifest = quantized.manifest
    evaluation = evaluated.evaluation
    return {
        "ok": evaluated.passed,
        "artifact": str(quantized.output),
        "calibration": manifest["calibration"]["path"],
        "name": manifest["name"],
        "version": manifest["version"],
        "plan": manifest["quantization"]["summary"],
        "size": {k: manifest["size"][k] for k in ("file_bytes", "ratio_to_fp32", "avg_bits_quantized")},
        "quality": manifest["quality"],
        "mmlu": {
            fmt: {
                "reference_accuracy": r.reference.accuracy,
                "accuracy": r.candidate.accuracy,
                "drift_points": r.drift_points,
                "drift_ci95_points": list(r.drift_ci95_points),
                "flip_rate": r.flips.flip_rate,
                "answer_kl": r.answer_kl.mean,
            }
            for fmt, r in evaluation.formats.items()
        },
        "heldout": json_value(evaluation.heldout),
        "gate": evaluation.gate.to_json(),
    }
