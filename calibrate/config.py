"""What `qpack calibrate` is asked for (`CalibrationConfig`) and what it returns (`CalibrationResult`).

Plain data, importable without torch (the command line builds its options and help from these fields and their
docstrings); `validate()` reports every problem at once, each named by its field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.clean import TURNS
from calibrate.coverage import CoverageThresholds
from calibrate.sources import FORMATS
from quantize.common.config import Problems


@dataclass(frozen=True)
class CalibrationConfig:
    """Everything a calibration run reads; `run_calibration(config)` runs it."""

    output: Path
    """Calibration directory to write."""
    model: str | None = None
    """HF folder, .gguf file, Hub id, or alias (default: smollm2-135m)."""
    queries: tuple[str, ...] = ()
    """Query file(s): JSONL, JSON, CSV, TSV, TXT, Parquet or a saved datasets folder (default: ShareGPT)."""
    format: str | None = None
    """Force the input format (default: from the extension)."""
    field: str | None = None
    """Field/column holding the query or messages."""
    turns: str = "first"
    """Which user turns to use: first or all."""
    chat_template: bool = True
    """Render samples with the model's chat template."""
    min_tokens: int = 4
    """Drop samples shorter than this (tokens)."""
    max_tokens: int = 512
    """Drop samples longer than this (tokens)."""
    num_samples: int = 512
    """Samples to keep (calibration + held-out)."""
    heldout_fraction: float = 0.1
    """Fraction of the samples held out for PPL/KL checks."""
    seed: int = 0
    """Seed for sampling."""
    reference: tuple[str, ...] = ()
    """A sample of production traffic to check coverage against."""
    coverage: CoverageThresholds = dataclasses.field(default_factory=CoverageThresholds)
    """When the calibration set counts as covering the reference traffic."""
    keep_text: bool = False
    """Also store the (scrubbed) query text."""
    max_memory: int | None = None
    """Bytes the run may use (default: 90% of what is free at the start)."""
    overwrite: bool = False
    """Replace an existing calibration directory."""
    token_budget: int = 4096
    """Padded tokens per forward batch."""

    def validate(self) -> None:
        """Every problem at once (ConfigError), each named by its field."""
        problems = Problems()
        problems.check_choice(self.turns, "turns", TURNS)
        if self.format is not None:
            problems.check_choice(self.format, "format", FORMATS)
        problems.check(self.num_samples >= 1, "num_samples", f"must be at least 1 (got {self.num_samples})")
        problems.check(
            0.0 <= self.heldout_fraction < 1.0,
            "heldout_fraction",
            f"must be in [0, 1) (got {self.heldout_fraction})",
        )
        problems.check(self.min_tokens >= 1, "min_tokens", f"must be at least 1 (got {self.min_tokens})")
        problems.check(
            self.max_tokens >= self.min_tokens,
            "max_tokens",
            f"({self.max_tokens}) must be at least `min_tokens` ({self.min_tokens})",
        )
        problems.check(
            self.token_budget >= self.max_tokens,
            "token_budget",
            f"({self.token_budget}) must be at least `max_tokens` ({self.max_tokens})",
        )
        problems.check(
            self.max_memory is None or self.max_memory >= 2**26,
            "max_memory",
            f"must be at least 64 MiB (got {self.max_memory} bytes)",
        )
        problems.raise_if_any(self)


@dataclass
class CalibrationResult:
    """A written calibration directory: where, its manifest as written, how long it took."""

    output: Path
    manifest: dict[str, Any]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.output), "seconds": round(self.seconds, 2), "manifest": self.manifest}
