"""`--distill` as data: what the run may spend and how it learns, importable without torch (the command line builds
its options from these fields, and the manifest stores them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.common.config import Problems, fields_json


@dataclass(frozen=True)
class Distill:
    """Distillation of the quantized model's scales against the FP32 model's next-token distributions."""

    minutes: float = 10.0
    """Wall-clock budget of the distillation, in minutes (it stops earlier when the validation KL stops falling)."""
    lr: float = 5e-4
    """Adam's learning rate on each scale's log factor (a scale moves at most about lr a step). On SmolLM2
    int4/g128, 2e-3 first raised the validation KL by half (0.028 -> 0.043) and never got back under it in 24
    steps; 5e-4 lowered it at every measurement (0.028 -> 0.024 in 48 steps)."""
    batch_tokens: int = 1024
    """Calibration tokens per step (whole packed rows)."""
    eval_every: int = 8
    """Steps between two measurements of the validation KL."""
    patience: int = 3
    """Measurements without a new best validation KL before it stops."""
    validation: float = 0.15
    """Share of the calibration rows kept out of training to measure the validation KL on (early stopping);
    the held-out queries the artifact is judged on are never used."""
    max_steps: int = 2000
    """Most steps, whatever the budget."""
    seed: int = 0
    """Seed of the batch order."""

    def check(self, problems: Problems, prefix: str = "") -> None:
        problems.check(self.minutes > 0, prefix + "minutes", f"must be > 0 (got {self.minutes})")
        problems.check(0 < self.lr <= 0.1, prefix + "lr", f"must be in (0, 0.1] (got {self.lr})")
        problems.check(
            self.batch_tokens >= 16, prefix + "batch_tokens", f"must be at least 16 (got {self.batch_tokens})"
        )
        problems.check(
            self.eval_every >= 1, prefix + "eval_every", f"must be at least 1 (got {self.eval_every})"
        )
        problems.check(self.patience >= 1, prefix + "patience", f"must be at least 1 (got {self.patience})")
        problems.check(
            0 < self.validation < 1, prefix + "validation", f"must be in (0, 1) (got {self.validation})"
        )
        problems.check(
            self.max_steps >= 1, prefix + "max_steps", f"must be at least 1 (got {self.max_steps})"
        )

    def to_json(self) -> dict[str, Any]:
        return fields_json(self)
