"""What `qpack evaluate` is asked for: `EvaluateConfig` and its `Gate`, validated with every problem at once.

They live apart from `evals.pipeline` so that the scoring loops (`evals.paired`) and the command line read them
without importing the evaluation (or torch: the command line builds its options from these fields, and the string
under each field is both its documentation and its option's `--help`). Problems are named by field
("invalid EvaluateConfig: shots must be 0..5 (got 7)", "gate.max_drift ..."); the command line renames them to
its flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from quantize.common.config import Problems
from quantize.runtime.precision import DEFAULT_PREFILL_DTYPE, PREFILL_DTYPE_NAMES

FORMATS = ("letter", "cloze")


@dataclass(frozen=True)
class Gate:
    """Thresholds that fail an evaluation (exit code 1); None: not gated."""

    max_drift: float | None = None
    """Gate: fail if accuracy drops more (points)."""
    max_kl: float | None = None
    """Gate: fail if held-out next-token KL is higher (the MMLU answer KL without a calibration directory)."""
    max_flip_rate: float | None = None
    """Gate: fail if more answers flip (0-1)."""

    def checked(self) -> list[str]:
        return [f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v is not None]

    def validate(self) -> None:
        problems = Problems()
        for name, value in dataclasses.asdict(self).items():
            problems.check(value is None or value >= 0, name, f"must be >= 0 (got {value})")
        problems.raise_if_any(self)


@dataclass(frozen=True)
class EvaluateConfig:
    """Everything an evaluation reads; `evals.pipeline.evaluate(config)` runs it."""

    artifact: Path
    """Artifact directory."""
    reference: str | None = None
    """Reference model or artifact (default: the artifact's source, checked by its weights hash)."""
    mmlu: Path | None = None
    """MMLU directory (hendrycks or cais layout)."""
    subjects: str | None = None
    """Comma-separated subset of subjects."""
    limit: int | None = None
    """At most N questions per subject (stratified)."""
    shots: int = 5
    """Few-shot examples from the dev split (0-5)."""
    formats: tuple[str, ...] = ("letter",)
    """MMLU prompt formats to score: letter, cloze or both."""
    calibration: Path | None = None
    """Calibration dir for held-out PPL/KL (default: the one the artifact was quantized with)."""
    heldout_tokens: int = 2048
    """Held-out tokens for PPL/KL."""
    gate: Gate = dataclasses.field(default_factory=Gate)
    """Thresholds that fail the evaluation."""
    write: bool = True
    """Write results into the artifact."""
    token_budget: int = 4096
    """Tokens per scoring batch."""
    seed: int = 0
    """Seed for the limited sample, the question order and the bootstrap."""
    cache: bool = True
    """Reuse the reference's cached scores (and add to them)."""
    cache_dir: Path | None = None
    """Folder of the reference caches (default: qpack's user cache)."""
    sequential: bool = True
    """With a drift or flip-rate gate and no limit: stop once the gate is decided."""
    confidence: float = 0.95
    """Confidence of the sequential gate."""
    max_questions: int | None = None
    """Sequential: fail a gate still undecided after N questions (a time cap)."""
    prefill_dtype: str = DEFAULT_PREFILL_DTYPE
    """Precision of the artifact's prefill-sized products, as `qpack serve` runs them: float32, bfloat16 or
    int8 (int8 activations per token; the reference always runs float32)."""

    @property
    def is_sequential(self) -> bool:
        """Gated on drift or flips over the whole test set: stop as soon as the gate is decided."""
        gated = self.gate.max_drift is not None or self.gate.max_flip_rate is not None
        return self.sequential and gated and self.limit is None

    def validate(self) -> None:
        """Every problem at once (ConfigError), each named by its field."""
        problems = Problems()
        problems.check(0 <= self.shots <= 5, "shots", f"must be 0..5 (got {self.shots})")
        problems.check(bool(self.formats), "formats", "must name at least one of " + ", ".join(FORMATS))
        for fmt in self.formats:
            problems.check_choice(fmt, "formats", FORMATS)
        problems.check(
            self.limit is None or self.limit >= 1, "limit", f"must be at least 1 (got {self.limit})"
        )
        problems.check(
            self.heldout_tokens >= 1, "heldout_tokens", f"must be at least 1 (got {self.heldout_tokens})"
        )
        problems.nested("gate", self.gate.validate)
        problems.check(
            self.max_questions is None or self.max_questions >= 1,
            "max_questions",
            f"must be at least 1 (got {self.max_questions})",
        )
        problems.check(
            0.5 <= self.confidence < 1, "confidence", f"must be in [0.5, 1) (got {self.confidence})"
        )
        problems.check(
            self.token_budget >= 256, "token_budget", f"must be at least 256 (got {self.token_budget})"
        )
        problems.check_choice(self.prefill_dtype, "prefill_dtype", PREFILL_DTYPE_NAMES)
        problems.raise_if_any(self)
