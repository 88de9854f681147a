"""What `qpack quantize` is asked for (`QuantizeConfig`) and what it returns (`QuantizeResult`), as typed objects.

The config holds the objects the run uses, not their spellings: a `Preset`, candidate `Scheme`s (`Int4(64)`,
`Int8()`), plan rules as an ordered `{pattern: scheme}` map, an `Algorithm` with its settings (`GPTQ(damp=0.02)`),
a `SensitivityConfig`, an export (`CompressedTensors()`). `validate()` reports every problem at once, each named by
its field; the command line maps its flags onto these fields (`qpack/cli/quantization.py`) and shows the same
problems under the flag names. Each field's docstring is also its `--help`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.algorithms import Algorithm, Auto
from quantize.common.config import Problems, fields_json, json_value
from quantize.distill.settings import Distill
from quantize.formats.schemes import FP32, Int4, Scheme
from quantize.io.exports import CompressedTensors
from quantize.planning.plan import Plan, PlanRules
from quantize.planning.presets import PRESETS, Preset
from quantize.rotation import ROTATIONS
from quantize.sensitivity.settings import SensitivityConfig


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything a quantize run reads; `quantize_model(config)` runs it."""

    output: Path
    """Artifact directory to write."""
    calibration: Path
    """Calibration directory (qpack calibrate)."""
    model: str | None = None
    """HF folder, .gguf file, Hub id, or alias (default: the model the calibration was built for)."""
    name: str | None = None
    """Artifact name (default: model-preset)."""
    version: str = "1"
    """Artifact version."""
    preset: Preset = PRESETS["mixed"]
    """Candidate schemes and size budget (PRESETS): mixed (int4/int8/bf16 at 4.75 bits), int8, int4 or w8a8."""
    schemes: tuple[Scheme, ...] = ()
    """Candidate schemes for the planner instead of the preset's (int4-g128, int8, bf16, ...)."""
    target_bits: float | None = None
    """Average storage bits per quantized weight, scales and zero points included (default: the preset's)."""
    max_kl: float | None = None
    """Instead of a size budget: the fewest bits whose predicted KL stays under this."""
    overrides: Mapping[str, Scheme | None] = dataclasses.field(default_factory=dict)
    """Plan rules, pattern -> scheme (None: keep FP32): an exact module name beats a 're:' regex (first match wins),
    which beats '_default'."""
    algorithm: Algorithm = dataclasses.field(default_factory=Auto)
    """How weights are chosen: auto (GPTQ for int8/int4, SmoothQuant for w8a8), RTN, GPTQ, AWQ or SmoothQuant."""
    sensitivity: SensitivityConfig = dataclasses.field(default_factory=SensitivityConfig)
    """How per-layer sensitivity is measured for budgeted plans."""
    calib_tokens: int = 4096
    """Calibration tokens for GPTQ/AWQ/SmoothQuant."""
    eval_tokens: int = 2048
    """Held-out tokens the artifact is measured on against FP32 (KL, top-1, perplexity)."""
    distill: Distill | None = None
    """After quantizing: train the int4/int8 scales against the FP32 model's next-token distributions."""
    rotate: str = "none"
    """Rotate the residual stream before quantizing (none, hadamard: a randomized Hadamard rotation, absorbed into
    the weights, with a per-head one on v/o): spreads outlier channels over every group; the FP32 model computes
    the same. A tied LM head is stored untied (the final norm's scale is folded into it)."""
    rotate_seed: int | None = None
    """Seed of the rotation's random signs (default: `seed`); another value draws another rotation while the
    calibration and held-out tokens stay the same."""
    export: CompressedTensors | None = None
    """Also write the artifact in another format: compressed-tensors (for transformers and vLLM)."""
    overwrite: bool = False
    """Replace an existing artifact."""
    seed: int = 0
    """Seed for token sampling."""
    max_shard_size: int | None = None
    """Largest weight file in bytes (default 2 GB); larger artifacts are sharded with a Hugging Face index."""
    max_memory: int | None = None
    """Bytes the run may use (default: 90% of what is free at the start)."""

    def validate(self) -> None:
        """Every problem at once (ConfigError), each named by its field."""
        problems = Problems()
        self._check_budget(problems)
        self._check_candidates(problems)
        self.algorithm.check(problems, "algorithm.")
        self.sensitivity.check(problems, "sensitivity.")
        if self.distill is not None:
            self.distill.check(problems, "distill.")
        problems.check(
            self.max_shard_size is None or self.max_shard_size >= 2**14,
            "max_shard_size",
            f"must be at least 16 KiB (got {self.max_shard_size} bytes)",
        )
        problems.check(
            self.max_memory is None or self.max_memory >= 2**26,
            "max_memory",
            f"must be at least 64 MiB (got {self.max_memory} bytes)",
        )
        problems.check(
            self.calib_tokens >= 16, "calib_tokens", f"must be at least 16 (got {self.calib_tokens})"
        )
        problems.check(self.eval_tokens >= 16, "eval_tokens", f"must be at least 16 (got {self.eval_tokens})")
        problems.check(bool(self.version.strip()), "version", "must not be empty")
        problems.check_choice(self.rotate, "rotate", ROTATIONS)
        problems.raise_if_any(self)

    def _check_budget(self, problems: Problems) -> None:
        problems.check(
            self.target_bits is None or self.max_kl is None, "target_bits", "and `max_kl` exclude each other"
        )
        problems.check(
            self.target_bits is None or 2.0 <= self.target_bits <= 32.0,
            "target_bits",
            f"must be in [2, 32] (got {self.target_bits})",
        )
        problems.check(self.max_kl is None or self.max_kl > 0, "max_kl", f"must be > 0 (got {self.max_kl})")

    def _check_candidates(self, problems: Problems) -> None:
        for scheme in self.candidates():
            if isinstance(scheme, FP32):
                problems.add("schemes", "fp32 is not a candidate (keep layers FP32 with an override)")
            elif isinstance(scheme, Int4) and scheme.group_size not in Int4.GROUP_SIZES:
                problems.add(
                    "schemes", f"int4 group size must be one of {Int4.GROUP_SIZES} (got {scheme.group_size})"
                )
        problems.check(bool(self.candidates()), "preset", f"{self.preset.name} has no candidate schemes")
        try:
            self.rules()
        except ValueError as error:
            problems.add("overrides", str(error))

    def candidates(self) -> list[Scheme]:
        """The planner's candidate schemes: `schemes`, else the preset's (each once, in order)."""
        return list(dict.fromkeys(self.schemes or self.preset.candidates))

    def rules(self) -> PlanRules:
        """`overrides` as plan rules (ValueError naming every bad pattern)."""
        return PlanRules.of(self.overrides)

    def resolved_target_bits(self) -> float | None:
        """The size budget asked for: `target_bits`, else the preset's (None: uniform or by `max_kl`)."""
        return self.target_bits if self.target_bits is not None else self.preset.target_bits


@dataclass(frozen=True)
class HeldoutQuality:
    """A model against its reference on held-out tokens."""

    tokens: int
    kl: float  # mean next-token KL(reference || model), nats
    kl_p95: float
    top1_agreement: float  # share of positions where both predict the same next token
    ppl_reference: float
    ppl: float

    def to_json(self) -> dict[str, Any]:
        return fields_json(self)


@dataclass
class QuantizeResult:
    """A written artifact: where, its manifest as written, the plan, and what the run measured."""

    output: Path
    manifest: dict[str, Any]
    plan: Plan
    quality: HeldoutQuality
    seconds: float
    warnings: list[str]

    @property
    def name(self) -> str:
        return str(self.manifest["name"])

    @property
    def version(self) -> str:
        return str(self.manifest["version"])

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "seconds": round(self.seconds, 2),
            "warnings": list(self.warnings),
            "quality": json_value(self.quality),
            "manifest": self.manifest,
        }
