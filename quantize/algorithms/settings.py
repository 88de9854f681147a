"""What each algorithm is as data: a frozen dataclass of its settings, registered by name; and which one a layer gets.

A config holds these objects (`QuantizeConfig(algorithm=GPTQ(damp=0.02))`), the plan records which one each layer
got, and the manifest stores them as JSON (`{"name": "gptq", "damp": 0.02, ...}`), so a run can be read back and
repeated. Like schemes (data) and their handlers (tensors), the settings live here, importable without torch (the
command line builds its options from them), and the math of each method in its own module (`rtn`, `gptq`, `awq`,
`smoothquant`); the block-by-block pass (`quantize.sequential.apply`) dispatches on the object's type.

`Auto` (the default) gives each scheme its method: GPTQ for int8 and int4 weights, SmoothQuant for w8a8,
round-to-nearest for everything else (16-bit, bitsandbytes). Asking for a method a layer's scheme can't use (AWQ on
an int8 layer of a mixed plan) gives that layer its default, so one plan can mix schemes freely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from quantize.common.config import Problems, fields_json
from quantize.common.registry import Registry
from quantize.formats.schemes import Scheme

ALGORITHMS: Registry[Algorithm] = Registry("algorithm", lambda cls: cls.name)
register_algorithm = ALGORITHMS.register


@dataclass(frozen=True)
class Algorithm:
    """Base of the algorithms; subclasses set `name` and add their settings as fields."""

    name: ClassVar[str] = ""

    def check(self, problems: Problems, prefix: str = "") -> None:
        """Add this algorithm's invalid settings to `problems`, each field named `prefix` + its name."""

    def validate(self) -> None:
        problems = Problems()
        self.check(problems)
        problems.raise_if_any(self)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **fields_json(self)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Algorithm:
        """An algorithm as `to_json` wrote it (nested algorithms, like `Auto`'s, too)."""
        values = {
            k: Algorithm.from_json(v) if isinstance(v, dict) and "name" in v else v for k, v in data.items()
        }
        return ALGORITHMS.build(data.get("name"), values)


@register_algorithm
@dataclass(frozen=True)
class RTN(Algorithm):
    """Round to nearest: no settings."""

    name = "rtn"


@register_algorithm
@dataclass(frozen=True)
class GPTQ(Algorithm):
    """GPTQ for int8 (per channel) and int4 (per group) weights; other schemes round to nearest."""

    name = "gptq"
    damp: float = 0.01
    """GPTQ dampening, as a fraction of the Hessian's mean diagonal (0.01 = 1%)."""
    block_size: int = 128
    """Columns quantized between lazy updates of the rest of the weight (speed only, not results)."""
    act_order: bool = True
    """Quantize columns in order of decreasing Hessian diagonal (act-order; the stored format is unchanged)."""

    def check(self, problems: Problems, prefix: str = "") -> None:
        problems.check(0 < self.damp < 1, f"{prefix}damp", f"must be in (0, 1) (got {self.damp})")
        problems.check(self.block_size >= 1, f"{prefix}block_size", f"must be >= 1 (got {self.block_size})")


@register_algorithm
@dataclass(frozen=True)
class AWQ(Algorithm):
    """AWQ scale search for int4 groups (folded into the norm or linear in front); the weights are then rounded
    to nearest."""

    name = "awq"
    grid: int = 20
    """Points of the alpha grid in [0, 1] searched per input group."""

    def check(self, problems: Problems, prefix: str = "") -> None:
        problems.check(self.grid >= 1, f"{prefix}grid", f"must be >= 1 (got {self.grid})")


@register_algorithm
@dataclass(frozen=True)
class SmoothQuant(Algorithm):
    """SmoothQuant migration for w8a8 layers (folded into the norm or linear in front, else stored beside the
    weight), then round to nearest."""

    name = "smoothquant"
    alpha: float = 0.5
    """Migration strength in [0, 1]: 0 leaves activations as they are, 1 moves all their range into weights."""

    def check(self, problems: Problems, prefix: str = "") -> None:
        problems.check(0.0 <= self.alpha <= 1.0, f"{prefix}alpha", f"must be in [0, 1] (got {self.alpha})")


@register_algorithm
@dataclass(frozen=True)
class AutoRound(Algorithm):
    """AutoRound for int8 and int4 weights: per decoder block, a rounding offset per weight and a clipping factor
    per group's minimum and maximum, learned by signed gradient descent on the block's output error against
    the FP32 block; other schemes round to nearest."""

    name = "autoround"
    iters: int = 200
    """Signed-gradient steps per decoder block."""
    lr: float = 0.0
    """Step size at the first step, decaying linearly to 0 (0 = 1 / iters, AutoRound's default)."""
    batch_tokens: int = 2048
    """Calibration tokens per step (whole packed rows, drawn in a seeded order)."""
    init: str = "rtn"
    """The rounding learning starts from: `rtn` or `gptq` (GPTQ's codes, with `gptq`'s settings)."""
    gptq: GPTQ = dataclasses.field(default_factory=GPTQ)
    """The GPTQ settings of `init = "gptq"`."""
    seed: int = 0
    """Seed of the batches' order."""
    INITS: ClassVar[tuple[str, ...]] = ("rtn", "gptq")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr > 0 else 1.0 / self.iters

    def check(self, problems: Problems, prefix: str = "") -> None:
        problems.check(self.iters >= 1, f"{prefix}iters", f"must be >= 1 (got {self.iters})")
        problems.check(0 <= self.lr <= 1, f"{prefix}lr", f"must be in [0, 1] (got {self.lr})")
        problems.check(
            self.batch_tokens >= 1, f"{prefix}batch_tokens", f"must be >= 1 (got {self.batch_tokens})"
        )
        problems.check(
            self.init in self.INITS,
            f"{prefix}init",
            f"must be one of {', '.join(self.INITS)} (got {self.init!r})",
        )
        self.gptq.check(problems, f"{prefix}gptq.")


@register_algorithm
@dataclass(frozen=True)
class Auto(Algorithm):
    """Each scheme's default method, with these settings."""

    name = "auto"
    gptq: GPTQ = dataclasses.field(default_factory=GPTQ)
    """The GPTQ settings used for int8 and int4 layers."""
    smoothquant: SmoothQuant = dataclasses.field(default_factory=SmoothQuant)
    """The SmoothQuant settings used for w8a8 layers."""
    DEFAULTS: ClassVar[dict[str, str]] = {"int8": "gptq", "int4": "gptq", "w8a8": "smoothquant"}

    def check(self, problems: Problems, prefix: str = "") -> None:
        self.gptq.check(problems, f"{prefix}gptq.")
        self.smoothquant.check(problems, f"{prefix}smoothquant.")

    def default_for(self, scheme: Scheme) -> Algorithm:
        default = self.DEFAULTS.get(scheme.type)
        if default == "gptq" and "gptq" in scheme.algorithms:
            return self.gptq
        if default == "smoothquant" and "smoothquant" in scheme.algorithms:
            return self.smoothquant
        return RTN()


def algorithm_for(scheme: Scheme, requested: Algorithm) -> Algorithm:
    """The algorithm a layer stored as `scheme` gets when `requested` is asked for."""
    if isinstance(requested, Auto):
        return requested.default_for(scheme)
    if requested.name in scheme.algorithms:
        return requested
    return Auto().default_for(scheme)
