"""`qpack build`: calibrate -> quantize -> evaluate with a gate, as one step of a CI model-build pipeline.

Each stage is the same library call the individual commands make, so a build is reproducible command by
command. The calibration directory is kept beside the artifact (`ARTIFACT.calibration`) because the artifact
manifest points at it for held-out checks and the sensitivity cache lives there, so rebuilding with another
budget skips the expensive part. The result is one JSON summary; the exit code is the gate's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate import CalibrationConfig, run_calibration
from evals.config import EvaluateConfig, Gate
from evals.pipeline import evaluate
from evals.results import EvaluateResult
from quantize.common.config import ConfigError, Problems, json_value, one_of
from quantize.common.errors import QpackError
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.config import QuantizeConfig, QuantizeResult
from quantize.pipeline import quantize_model
from quantize.planning.plan import PlanRules
from quantize.planning.presets import PRESETS


@dataclass(frozen=True)
class BuildConfig:
    output: Path
    model: str | None = None
    queries: tuple[str, ...] = ()
    calibration: Path | None = None
    num_samples: int = 512
    preset: str = "mixed"
    target_bits: float | None = None
    max_kl_budget: float | None = None
    overrides: tuple[str, ...] = ()
    name: str | None = None
    version: str = "1"
    mmlu: Path | None = None
    subjects: str | None = None
    limit: int | None = 5
    shots: int = 5
    formats: tuple[str, ...] = ("letter",)
    gate: Gate = dataclasses.field(default_factory=Gate)
    overwrite: bool = False
    seed: int = 0

    @property
    def calibration_dir(self) -> Path:
        return self.calibration or self.output.with_name(self.output.name + ".calibration")

    def evaluate_config(self, output: Path, calibration: Path) -> EvaluateConfig:
        return EvaluateConfig(
            artifact=output,
            mmlu=self.mmlu,
            subjects=self.subjects,
            limit=self.limit,
            shots=self.shots,
            formats=self.formats,
            calibration=calibration,
            gate=self.gate,
            seed=self.seed,
        )

    def validate(self) -> None:
        """Every problem at once (ConfigError), before calibrating and quantizing, which take minutes."""
        problems = Problems()
        problems.check(self.preset in PRESETS, "preset", one_of(self.preset, PRESETS))
        try:
            self.evaluate_config(self.output, self.calibration_dir).validate()
        except ConfigError as error:
            for problem in error.problems:  # the evaluation's fields are this config's, by the same names
                problems.add(problem.field, problem.message)
        problems.raise_if_any(self)


@dataclass
class BuildResult:
    summary: dict[str, Any]
    quantized: QuantizeResult
    evaluated: EvaluateResult


def run_build(config: BuildConfig, progress: Progress = NULL_PROGRESS) -> BuildResult:
    started = time.perf_counter()
    output = Path(config.output).expanduser().resolve()
    if output.exists() and not config.overwrite:
        raise QpackError(f"artifact directory {output} already exists; pass --overwrite to rebuild it")
    config.validate()
    calibration_dir = Path(config.calibration_dir).expanduser().resolve()
    stages: dict[str, float] = {}
    if config.calibration is None or not (calibration_dir / "manifest.json").is_file():
        phase = time.perf_counter()
        run_calibration(
            CalibrationConfig(
                output=calibration_dir,
                model=config.model,
                queries=config.queries,
                num_samples=config.num_samples,
                seed=config.seed,
                overwrite=config.overwrite,
            ),
            progress,
        )
        stages["calibrate"] = time.perf_counter() - phase
    phase = time.perf_counter()
    quantized = quantize_model(
        QuantizeConfig(
            output=output,
            calibration=calibration_dir,
            model=config.model,
            name=config.name,
            version=config.version,
            preset=PRESETS[config.preset],
            target_bits=config.target_bits,
            max_kl=config.max_kl_budget,
            overrides=PlanRules.parse(config.overrides),
            overwrite=config.overwrite,
            seed=config.seed,
        ),
        progress,
    )
    stages["quantize"] = time.perf_counter() - phase
    phase = time.perf_counter()
    evaluated = evaluate(config.evaluate_config(output, calibration_dir), progress)
    stages["evaluate"] = time.perf_counter() - phase
    summary = _summary(output, calibration_dir, quantized, evaluated, stages)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return BuildResult(summary, quantized, evaluated)


def _summary(
    output: Path,
    calibration_dir: Path,
    quantized: QuantizeResult,
    evaluated: EvaluateResult,
    stages: dict[str, float],
) -> dict[str, Any]:
    """The one JSON document a CI step reads: where things are, size, quality, MMLU drift, the gate."""
    manifest = quantized.manifest
    evaluation = evaluated.evaluation
    return {
        "ok": evaluated.passed,
        "artifact": str(output),
        "calibration": str(calibration_dir),
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
        "stages_s": {k: round(v, 1) for k, v in stages.items()},
    }
