"""`qpack compare`: several artifacts side by side against one reference, the table a model-build PR needs.

Each artifact is evaluated on the same MMLU questions (fixed sample: `--limit`, or all) against the same
reference. The reference is scored once: the first evaluation fills the reference-score cache and the others
read it (with --no-cache it is scored for each). Speed is measured in a fresh worker process per artifact
(qpack's engine, batch 1: prefill of a `prompt_tokens` random prompt, then `new_tokens` decode steps, the
median of `repeats`), one artifact after the other, so the numbers are comparable within one run only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.config import EvaluateConfig
from evals.results import Evaluation
from quantize.common.config import Problems
from quantize.common.errors import QpackError
from quantize.common.fileio import write_bytes, write_json
from quantize.common.progress import NULL_PROGRESS, Progress


@dataclass(frozen=True)
class CompareConfig:
    """Several artifacts side by side against one reference."""

    artifacts: tuple[Path, ...]
    """Artifact directories."""
    reference: str | None = None
    """Reference model or artifact (default: the first artifact's source)."""
    mmlu: Path | None = None
    """MMLU directory (hendrycks or cais layout)."""
    subjects: str | None = None
    """Comma-separated subset of subjects."""
    limit: int | None = None
    """At most N questions per subject (stratified)."""
    shots: int = 5
    """Few-shot examples from the dev split (0-5)."""
    fmt: str = "letter"
    """MMLU prompt format: letter or cloze."""
    seed: int = 0
    """Seed for the limited sample and the bootstrap."""
    cache: bool = True
    """Reuse the reference's cached scores (and add to them)."""
    speed: bool = True
    """Measure batch-1 prefill and decode speed."""
    prompt_tokens: int = 256
    """Prompt length of the speed measurement."""
    new_tokens: int = 32
    """Tokens generated in the speed measurement."""
    repeats: int = 3
    """Runs of the speed measurement (median reported)."""
    output: Path | None = None
    """Write PATH.md and PATH.json."""

    def validate(self) -> None:
        """Every problem at once (ConfigError), each named by its field."""
        problems = Problems()
        problems.check(bool(self.artifacts), "artifacts", "must name at least one artifact directory")
        for path in self.artifacts:
            problems.check(
                (Path(path) / "manifest.json").is_file(),
                "artifacts",
                f"{path} is not an artifact (no manifest.json)",
            )
        problems.check(
            len(set(map(str, self.artifacts))) == len(self.artifacts), "artifacts", "name one twice"
        )
        problems.check(self.prompt_tokens >= 1, "prompt_tokens", f"must be >= 1 (got {self.prompt_tokens})")
        problems.check(self.new_tokens >= 2, "new_tokens", f"must be >= 2 (got {self.new_tokens})")
        problems.check(self.repeats >= 1, "repeats", f"must be >= 1 (got {self.repeats})")
        if self.output is not None:
            folder = _stem(Path(self.output)).parent
            problems.check(folder.is_dir(), "output", f"folder {folder} does not exist; create it first")
        problems.raise_if_any(self)


def measure_speed(artifact: Path, prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, float]:
    from qpack.bench.decode import Worker

    worker = Worker("artifact", str(artifact), 1, prompt_tokens + new_tokens)
    try:
        runs = [
            worker.call(
                {"batch": 1, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "seed": repeat}
            )
            for repeat in range(repeats + 1)
        ][1:]  # the first run warms up
    finally:
        worker.close()
    return {
        "prefill_tokens_per_s": statistics.median(prompt_tokens / r["prefill_s"] for r in runs),
        "decode_tokens_per_s": statistics.median((new_tokens - 1) / r["decode_s"] for r in runs),
    }


def _row(artifact: Path, evaluation: Evaluation, fmt: str, speed: dict[str, float] | None) -> dict[str, Any]:
    from quantize.io.artifact import read_manifest

    manifest = read_manifest(artifact)
    size = manifest.get("size", {})
    report = evaluation.formats[fmt]
    return {
        "artifact": str(artifact),
        "name": f"{manifest.get('name', artifact.name)} v{manifest.get('version', '')}",
        "bytes": size.get("tensor_bytes"),
        "ratio_to_fp32": size.get("ratio_to_fp32"),
        "avg_bits": size.get("avg_bits_quantized"),
        "speed": speed,
        "accuracy": report.candidate.accuracy,
        "accuracy_ci95": list(report.candidate.ci95),
        "reference_accuracy": report.reference.accuracy,
        "drift_points": report.drift_points,
        "drift_ci95_points": list(report.drift_ci95_points),
        "flip_rate": report.flips.flip_rate,
        "answer_kl": report.answer_kl.mean,
        "heldout_kl": evaluation.heldout.kl if evaluation.heldout else None,
        "questions": report.questions,
        "numerics": evaluation.numerics.to_json(),
    }


def compare(config: CompareConfig, progress: Progress = NULL_PROGRESS) -> dict[str, Any]:
    from evals.pipeline import evaluate

    config.validate()
    rows, reference_id = [], None
    for artifact in config.artifacts:
        evaluation = evaluate(
            EvaluateConfig(
                artifact=Path(artifact),
                reference=config.reference,
                mmlu=config.mmlu,
                subjects=config.subjects,
                limit=config.limit,
                shots=config.shots,
                formats=(config.fmt,),
                write=False,
                seed=config.seed,
                cache=config.cache,
                sequential=False,
            ),
            progress,
        ).evaluation
        reference_id = reference_id or evaluation.reference.id
        if evaluation.reference.id != reference_id:
            raise QpackError(
                f"{artifact} has a different source model ({evaluation.reference.id} vs {reference_id}); "
                "give `reference` to compare against one model"
            )
        speed = None
        if config.speed:
            with progress.task(f"Speed: {Path(artifact).name} (batch 1)"):
                speed = measure_speed(Path(artifact), config.prompt_tokens, config.new_tokens, config.repeats)
        rows.append(_row(Path(artifact), evaluation, config.fmt, speed))
    result = {
        "reference": reference_id,
        "format": config.fmt,
        "shots": config.shots,
        "limit": config.limit,
        "speed_settings": {
            "prompt_tokens": config.prompt_tokens,
            "new_tokens": config.new_tokens,
            "batch": 1,
        },
        "rows": rows,
    }
    if config.output is not None:
        write_outputs(Path(config.output), result)
    return result


def compare_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### qpack compare against `{result['reference']}` (MMLU {result['format']}, {result['shots']}-shot, "
        f"{result['rows'][0]['questions'] if result['rows'] else 0} questions)",
        "",
        "| artifact | size | avg bits | decode tok/s (b1) | prefill tok/s | MMLU acc (95% CI) | drift pts (95% CI) "
        "| flips | KL |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        speed = row["speed"] or {}
        low, high = row["drift_ci95_points"]
        kl = row["heldout_kl"] if row["heldout_kl"] is not None else row["answer_kl"]
        lines.append(
            f"| {row['name']} | {(row['bytes'] or 0) / 2**20:.1f} MiB ({row['ratio_to_fp32']}x) | {row['avg_bits']} "
            f"| {speed.get('decode_tokens_per_s', float('nan')):.1f} | {speed.get('prefill_tokens_per_s', float('nan')):.0f} "
            f"| {row['accuracy']:.1%} [{row['accuracy_ci95'][0]:.1%}, {row['accuracy_ci95'][1]:.1%}] "
            f"| {row['drift_points']:+.2f} [{low:+.2f}, {high:+.2f}] | {row['flip_rate']:.1%} | {kl:.4f} |"
        )
    lines += [
        "",
        "KL: next-token KL on held-out calibration queries where available, else the MMLU answer KL.",
    ]
    return "\n".join(lines) + "\n"


def write_outputs(path: Path, result: dict[str, Any]) -> None:
    """PATH.md and PATH.json (a path ending in .md or .json names the pair), each written atomically."""
    stem = _stem(path)
    write_bytes(stem.with_suffix(".md"), compare_markdown(result).encode())
    write_json(stem.with_suffix(".json"), result)


def _stem(path: Path) -> Path:
    return path.with_suffix("") if path.suffix in (".md", ".json") else path
