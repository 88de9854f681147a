"""Quantization schemes: frozen dataclasses, a registry keyed by a type tag, JSON with a version.

A scheme says *what* a layer is stored as (int8 per channel, int4 per group, ...). How the weights are chosen
(RTN, GPTQ, AWQ, SmoothQuant) is the algorithm (`quantize.algorithms`); the scheme's stored tensors and how they
become a runtime module are its handler's (`quantize.runtime.handlers`), and what that module computes with is
`quantize.runtime.modules`. Keeping schemes as plain data (no torch) lets plans, sensitivity caches and artifact
manifests round-trip through JSON and configs name them anywhere, and new schemes register themselves instead of
growing `if mode == ...` chains.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from quantize.common.errors import QpackError
from quantize.common.registry import Registry

SCHEMES: Registry[Scheme] = Registry("scheme type", lambda cls: cls.type)
register_scheme = SCHEMES.register


@dataclass(frozen=True)
class Scheme:
    """Base of all schemes. Subclasses set `type`, `version` and `algorithms` and add their parameters."""

    type: ClassVar[str] = ""
    version: ClassVar[int] = 1
    algorithms: ClassVar[tuple[str, ...]] = ("rtn",)
    extra: ClassVar[str | None] = None

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        """Effective storage bits per weight, scales and zero points included."""
        raise NotImplementedError

    def problems(self, in_features: int, out_features: int) -> list[str]:
        """Why this scheme cannot store a [out_features, in_features] weight (empty when it can)."""
        return []

    def label(self) -> str:
        return self.type

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "version": self.version, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Scheme:
        kind = data.get("type")
        cls = SCHEMES.class_of(kind)
        if data.get("version", 1) > cls.version:
            raise QpackError(
                f"scheme {kind!r} version {data.get('version')} is newer than this qpack supports ({cls.version}); "
                "upgrade qpack"
            )
        return SCHEMES.build(kind, data)


@register_scheme
@dataclass(frozen=True)
class FP32(Scheme):
    type: ClassVar[str] = "fp32"

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 32.0


@register_scheme
@dataclass(frozen=True)
class BF16(Scheme):
    type: ClassVar[str] = "bf16"

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 16.0


@register_scheme
@dataclass(frozen=True)
class FP16(Scheme):
    type: ClassVar[str] = "fp16"

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 16.0


@register_scheme
@dataclass(frozen=True)
class Int8(Scheme):
    """W8A16: int8 weights, symmetric per output channel (fp32 scale), activations stay floating point."""

    type: ClassVar[str] = "int8"
    algorithms: ClassVar[tuple[str, ...]] = ("rtn", "gptq", "autoround")

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 8.0 + 32.0 / in_features


@register_scheme
@dataclass(frozen=True)
class Int4(Scheme):
    """W4A16: int4 weights, asymmetric per group of `group_size` input channels (fp16 scale, uint8 zero)."""

    type: ClassVar[str] = "int4"
    algorithms: ClassVar[tuple[str, ...]] = ("rtn", "gptq", "awq", "autoround")
    group_size: int = 64
    GROUP_SIZES: ClassVar[tuple[int, ...]] = (32, 64, 128)

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 4.0 + (16.0 + 8.0) / self.group_size

    def problems(self, in_features: int, out_features: int) -> list[str]:
        problems = []
        if self.group_size not in self.GROUP_SIZES:
            problems.append(f"group_size {self.group_size} is not one of {self.GROUP_SIZES}")
        elif in_features % self.group_size:
            problems.append(f"in_features {in_features} is not divisible by group_size {self.group_size}")
        return problems

    def label(self) -> str:
        return f"int4-g{self.group_size}"


@register_scheme
@dataclass(frozen=True)
class W8A8(Scheme):
    """int8 weights per channel + dynamic per-token int8 activations, with SmoothQuant migration `alpha`."""

    type: ClassVar[str] = "w8a8"
    algorithms: ClassVar[tuple[str, ...]] = ("smoothquant", "rtn")
    alpha: float = 0.5

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 8.0 + 32.0 / in_features + 32.0 / out_features

    def problems(self, in_features: int, out_features: int) -> list[str]:
        return [] if 0.0 <= self.alpha <= 1.0 else [f"alpha {self.alpha} is not in [0, 1]"]


@register_scheme
@dataclass(frozen=True)
class BnbInt8(Scheme):
    """LLM.int8() through bitsandbytes (optional extra `bnb`), for comparison with qpack's own kernels."""

    type: ClassVar[str] = "bnb-int8"
    extra: ClassVar[str | None] = "bnb"
    threshold: float = 6.0

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 8.0 + 32.0 / in_features


@register_scheme
@dataclass(frozen=True)
class BnbNF4(Scheme):
    """4-bit NormalFloat through bitsandbytes (optional extra `bnb`), blockwise absmax."""

    type: ClassVar[str] = "bnb-nf4"
    extra: ClassVar[str | None] = "bnb"
    blocksize: int = 64

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        return 4.0 + 32.0 / self.blocksize

    def problems(self, in_features: int, out_features: int) -> list[str]:
        if (in_features * out_features) % self.blocksize:
            return [f"{in_features * out_features} weights are not divisible by blocksize {self.blocksize}"]
        return []

    def label(self) -> str:
        return "bnb-nf4"


_SHORTHAND = re.compile(r"^(?P<type>[a-z0-9\-]+?)(?:-g(?P<group>\d+))?$")


def parse_scheme(text: str) -> Scheme | None:
    """`int8`, `int4`, `int4-g128`, `w8a8`, `bf16`, `fp16`, `bnb-nf4`... ; `fp32`/`none`/`keep` -> None (unquantized)."""
    value = text.strip().lower()
    if value in ("none", "keep", "fp32"):
        return None
    match = _SHORTHAND.match(value)
    if match is None or match.group("type") not in SCHEMES:
        raise QpackError(
            f"unknown scheme {text!r}; use one of fp32, bf16, fp16, int8, int4, int4-g32, int4-g64, int4-g128, "
            "w8a8, bnb-int8, bnb-nf4"
        )
    cls = SCHEMES[match.group("type")]
    if match.group("group") is not None:
        if cls is not Int4:
            raise QpackError(f"scheme {text!r}: only int4 takes a group size (-gN)")
        return Int4(group_size=int(match.group("group")))
    return cls()
