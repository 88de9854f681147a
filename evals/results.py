"""What `qpack evaluate` measured, as typed records the application reads by attribute.

The same records are written as JSON: the `--json` output of `qpack evaluate` and `qpack build`, each report
folder's `mmlu.json` and the manifest's `evals.mmlu`. That JSON is read by CI steps and stored in existing
artifacts, so each `to_json()` keeps the shape the result had before it was typed, key for key: a record's
fields are its keys (tuples as lists), except where a `to_json` says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.common.config import fields_json, json_value
from quantize.config import HeldoutQuality


class Record:
    """A result whose JSON is its fields."""

    def to_json(self) -> dict[str, Any]:
        return fields_json(self)


@dataclass(frozen=True)
class Accuracy(Record):
    """One model's MMLU accuracy."""

    accuracy: float
    ci95: tuple[float, float]
    """Wilson 95% interval."""
    correct: int
    total: int


@dataclass(frozen=True)
class Flips(Record):
    """Answers that changed between the reference and the artifact."""

    right_to_wrong: int
    wrong_to_right: int
    changed: int
    """Questions where the two models chose different answers, right or wrong."""
    flip_rate: float


@dataclass(frozen=True)
class AnswerKL(Record):
    """KL(reference || artifact) of the answer distributions (softmax over the four choice scores)."""

    mean: float
    p95: float


@dataclass(frozen=True)
class SubjectDrift(Record):
    """One MMLU subject's accuracies and drift."""

    n: int
    reference: float
    candidate: float
    drift_points: float
    drift_ci95_points: tuple[float, float]
    """Paired bootstrap 95% interval."""
    flips: int


@dataclass(frozen=True)
class GateDecision(Record):
    """A sequential gate's verdict ('pass' or 'fail'), the confidence sequence it rests on and when it was
    reached."""

    verdict: str
    questions: int
    interval: tuple[float, float]
    threshold: float


@dataclass(frozen=True)
class SequentialSummary(Record):
    """How a sequentially gated format was scored: how many questions, why it stopped, what was decided."""

    confidence: float
    method: str
    population: int
    scored: int
    questions_needed: int
    stopped: str
    decisions: dict[str, GateDecision]
    """By gate ('drift', 'flips'), the decided ones."""
    undecided: tuple[str, ...]
    drop_interval_points: tuple[float, float]
    flip_rate_interval: tuple[float, float]


@dataclass(frozen=True)
class DriftReport(Record):
    """One prompt format: both models' accuracy, the drift between them, flips and answer KL."""

    questions: int
    reference: Accuracy
    candidate: Accuracy
    drift_points: float
    """Artifact minus reference accuracy, points."""
    drift_ci95_points: tuple[float, float]
    """Paired bootstrap 95% interval."""
    flips: Flips
    answer_kl: AnswerKL
    top1_agreement: float
    subjects: dict[str, SubjectDrift]
    kl_values: tuple[float, ...] = dataclasses.field(repr=False)
    """Per question, for the histogram; not part of the JSON."""
    sequential: SequentialSummary | None = None
    """Set when the format was scored until its gates were decided; in the JSON only then."""

    def to_json(self) -> dict[str, Any]:
        left_out = {"kl_values", *(("sequential",) if self.sequential is None else ())}
        return {
            f.name: json_value(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in left_out
        }


@dataclass(frozen=True)
class HeldoutResult(HeldoutQuality):
    """The artifact against its reference on held-out calibration queries."""

    calibration_manifest_sha256: str
    reference_hidden: str
    """Where the reference's hidden states came from: 'cache' or 'computed'."""


@dataclass(frozen=True)
class GateOutcome:
    """The gate's thresholds (as `name=value`) and why it failed (nothing: it passed)."""

    checked: tuple[str, ...]
    reasons: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        return {"checked": list(self.checked), "passed": self.passed, "reasons": list(self.reasons)}


@dataclass(frozen=True)
class Numerics(Record):
    """How the artifact computed (`quantize.runtime.modules.numerics`)."""

    prefill_dtype: str
    native_kernels: str | None
    """The native kernel build in use; None: torch's ops."""
    prompt_path: str = ""
    """The kernels prompt-sized products ran on (`quantize.runtime.modules.prompt_path`)."""


@dataclass(frozen=True)
class ArtifactInfo(Record):
    name: str
    version: str
    path: str


@dataclass(frozen=True, kw_only=True)
class ReferenceInfo:
    """What the artifact was compared with, and the identity its cached scores are keyed by."""

    id: str
    kind: str
    """'artifact', or where a model came from ('folder', 'hub', ...)."""
    path: str | None = None
    """An artifact's directory."""
    weights_sha256: str | None = None
    """A model's weights hash."""
    content_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in fields_json(self).items() if v is not None}


@dataclass(frozen=True)
class MmluSummary(Record):
    """The MMLU questions scored."""

    layout: str
    source: str
    sha256: str
    subjects: int
    questions: int
    shots: int
    limit: int | None


@dataclass(frozen=True)
class CacheUse(Record):
    """Where a format's reference scores are cached and how many were read from there."""

    path: str
    questions_from_cache: int


@dataclass(frozen=True)
class Evaluation(Record):
    """Everything an evaluation measured: what `mmlu.json` and the manifest's `evals.mmlu` hold."""

    artifact: ArtifactInfo
    reference: ReferenceInfo
    numerics: Numerics
    mmlu: MmluSummary
    formats: dict[str, DriftReport]
    heldout: HeldoutResult | None
    heldout_note: str | None
    """Why there is no held-out result."""
    items_per_second: dict[str, float]
    reference_cache: dict[str, CacheUse | None]
    """By format; None: not cached (--no-cache)."""
    reference_loaded: bool
    """False when every reference result came from the caches."""
    timings_s: dict[str, float]
    gate: GateOutcome
    evaluated_at: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.gate.passed

    @property
    def reasons(self) -> list[str]:
        return list(self.gate.reasons)


@dataclass(frozen=True)
class EvaluateResult:
    """An evaluation and the folder its reports were written to (None: not written)."""

    evaluation: Evaluation
    report_dir: Path | None

    @property
    def passed(self) -> bool:
        return self.evaluation.passed

    @property
    def reasons(self) -> list[str]:
        return self.evaluation.reasons

    def to_json(self) -> dict[str, Any]:
        """The `--json` output of `qpack evaluate`."""
        return {
            "ok": self.passed,
            **self.evaluation.to_json(),
            "report_dir": str(self.report_dir) if self.report_dir else None,
        }
