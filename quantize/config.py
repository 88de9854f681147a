"""What `qpack quantize` is asked for (`QuantizeConfig`, validated with every problem at once) and what it
returns (`QuantizeResult`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize import algorithms as A
from quantize.common.errors import QpackError
from quantize.formats.schemes import Int4, parse_scheme
from quantize.io.artifact import (
    DEFAULT_SHARD_BYTES,
)
from quantize.planning.plan import Plan, PlanRules
from quantize.planning.presets import PRESETS
from quantize.sensitivity.measure import METHODS, SensitivityConfig


@dataclass(frozen=True)
class QuantizeConfig:
    output: Path
    calibration: Path
    model: str | None = None
    name: str | None = None
    version: str = "1"
    preset: str = "mixed"
    target_bits: float | None = None
    max_kl: float | None = None
    schemes: tuple[str, ...] = ()
    group_size: int = 64
    overrides: tuple[str, ...] = ()
    algorithm: str = "auto"
    gptq: A.GPTQConfig = dataclasses.field(default_factory=A.GPTQConfig)
    awq: A.AWQConfig = dataclasses.field(default_factory=A.AWQConfig)
    smoothquant_alpha: float = 0.5
    sensitivity: SensitivityConfig = dataclasses.field(default_factory=SensitivityConfig)
    calib_tokens: int = 4096
    eval_tokens: int = 2048
    export: str | None = None
    overwrite: bool = False
    seed: int = 0
    max_shard_size: int = DEFAULT_SHARD_BYTES
    max_memory: int | None = None  # bytes; None: from free RAM

    def validate(self) -> None:
        problems: list[str] = []
        if self.preset not in PRESETS:
            problems.append(f"--preset must be one of {', '.join(PRESETS)} (got {self.preset!r})")
        if self.target_bits is not None and self.max_kl is not None:
            problems.append("give --target-bits or --max-kl, not both")
        if self.target_bits is not None and not 2.0 <= self.target_bits <= 32.0:
            problems.append(f"--target-bits must be in [2, 32] (got {self.target_bits})")
        if self.max_kl is not None and self.max_kl <= 0:
            problems.append(f"--max-kl must be > 0 (got {self.max_kl})")
        if self.group_size not in Int4.GROUP_SIZES:
            problems.append(f"--group-size must be one of {Int4.GROUP_SIZES} (got {self.group_size})")
        if self.algorithm not in ("auto", *A.ALGORITHMS):
            problems.append(
                f"--algorithm must be auto or one of {', '.join(A.ALGORITHMS)} (got {self.algorithm!r})"
            )
        if self.sensitivity.method not in METHODS:
            problems.append(
                f"--sensitivity must be one of {', '.join(METHODS)} (got {self.sensitivity.method!r})"
            )
        if self.max_shard_size < 2**14:
            problems.append(f"--max-shard-size must be at least 16 KiB (got {self.max_shard_size} bytes)")
        if self.max_memory is not None and self.max_memory < 2**26:
            problems.append(f"--max-memory must be at least 64 MiB (got {self.max_memory} bytes)")
        if self.sensitivity.num_tokens < 16:
            problems.append("--sensitivity-tokens must be at least 16")
        if self.calib_tokens < 16:
            problems.append("--calib-tokens must be at least 16")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            problems.append(f"--smoothquant-alpha must be in [0, 1] (got {self.smoothquant_alpha})")
        if self.export not in (None, "compressed-tensors"):
            problems.append(f"--export must be compressed-tensors (got {self.export!r})")
        if not self.version.strip():
            problems.append("--version must not be empty")
        for text in self.schemes:
            try:
                if parse_scheme(text) is None:
                    problems.append("--schemes: fp32 is not a candidate (use --override to keep layers FP32)")
            except QpackError as exc:
                problems.append(f"--schemes: {exc}")
        try:
            PlanRules.parse(self.overrides)
        except QpackError as exc:
            problems.append(str(exc))
        if problems:
            raise QpackError("invalid quantize options: " + "; ".join(problems))


@dataclass
class QuantizeResult:
    output: Path
    manifest: dict[str, Any]
    plan: Plan
    seconds: float
    warnings: list[str]
