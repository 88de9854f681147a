"""How sensitivity is measured, as settings (importable without torch: the command line builds its options from
them); `quantize.sensitivity.measure` runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quantize.common.config import Problems

Method = Literal["auto", "kl", "kl-all", "fisher", "mse"]
METHODS: tuple[Method, ...] = ("auto", "kl", "kl-all", "fisher", "mse")


@dataclass(frozen=True)
class SensitivityConfig:
    """How per-layer sensitivity is measured (only for plans under a size or KL budget)."""

    method: Method = "auto"
    """auto (exact kl where it fits budget_minutes, else fisher), kl, kl-all, fisher or mse."""
    num_tokens: int = 256
    """Held-out tokens sensitivity is measured on."""
    seed: int = 0
    """Seed for sampling those tokens."""
    pack_tokens: int = 512
    """Tokens per packed row of the passes."""
    budget_minutes: float = 10.0
    """Minutes exact KL may take before auto picks the Fisher estimate."""
    fisher_samples: int = 4
    """Labels drawn per position for the Fisher estimate."""
    calibration_layers: int = 4
    """Layers measured exactly to calibrate the Fisher estimate's scale."""

    def check(self, problems: Problems, prefix: str = "") -> None:
        problems.check_choice(self.method, f"{prefix}method", METHODS)
        problems.check(
            self.num_tokens >= 16, f"{prefix}num_tokens", f"must be at least 16 (got {self.num_tokens})"
        )
        problems.check(
            self.pack_tokens >= 16, f"{prefix}pack_tokens", f"must be at least 16 (got {self.pack_tokens})"
        )
        problems.check(
            self.budget_minutes > 0, f"{prefix}budget_minutes", f"must be > 0 (got {self.budget_minutes})"
        )
        problems.check(
            self.fisher_samples >= 1, f"{prefix}fisher_samples", f"must be >= 1 (got {self.fisher_samples})"
        )
        problems.check(
            self.calibration_layers >= 0,
            f"{prefix}calibration_layers",
            f"must be >= 0 (got {self.calibration_layers})",
        )

    def cache_key(self, weights_sha256: str) -> str:
        return f"tokens={self.num_tokens}:seed={self.seed}:weights={weights_sha256}"
