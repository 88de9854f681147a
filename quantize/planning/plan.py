"""The layer plan as data: ordered `{pattern: scheme | None}` rules resolved to `{fqn: scheme | None}`.

Users steer quantization with rules, not code: `re:.*down_proj=int8` keeps every down projection at int8,
`model.layers.0.mlp.gate_proj=bf16` pins one layer, `lm_head=int8` forces the head (with a warning). Like
torchao's `FqnToConfig`, an exact module name beats a `re:` pattern, patterns are tried in the order given,
and `_default` applies to everything else. Rules are resolved to a concrete per-module plan *before* the model
is touched, so the plan can be validated (every offending layer reported at once), printed, priced and saved.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from quantize.algorithms.settings import Algorithm
from quantize.common.errors import QpackError
from quantize.formats.schemes import Scheme, parse_scheme

DEFAULT_KEY = "_default"
REGEX_PREFIX = "re:"
_DECODER_LINEAR = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
HEAD_NAMES = ("lm_head",)
EMBEDDING_NAMES = ("embed_tokens", "wte", "embed")


def is_decoder_linear(fqn: str) -> bool:
    return _DECODER_LINEAR.match(fqn) is not None


def block_index(fqn: str) -> int:
    match = _DECODER_LINEAR.match(fqn)
    assert match is not None, fqn
    return int(match.group(1))


def short_name(fqn: str) -> str:
    return fqn.rsplit(".", 1)[-1]


def _regex_error(pattern: str) -> str | None:
    """Why a `re:` pattern does not compile (None for a valid one or a plain name)."""
    if not pattern.startswith(REGEX_PREFIX):
        return None
    try:
        re.compile(pattern[len(REGEX_PREFIX) :])
    except re.error as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class PlanRules:
    """Ordered rules; a rule's scheme `None` means "keep this module unquantized (FP32)"."""

    rules: tuple[tuple[str, Scheme | None], ...] = ()

    @classmethod
    def of(cls, rules: Mapping[str, Scheme | None]) -> PlanRules:
        """Rules from an ordered {pattern: scheme} map; ValueError naming every bad pattern at once."""
        problems = []
        for pattern, scheme in rules.items():
            if not isinstance(pattern, str) or not pattern.strip():
                problems.append(f"{pattern!r} is not a module name or re: pattern")
            elif (error := _regex_error(pattern)) is not None:
                problems.append(f"{pattern!r}: bad regex ({error})")
            if scheme is not None and not isinstance(scheme, Scheme):
                problems.append(f"{pattern!r}: {scheme!r} is not a scheme (e.g. Int8()) or None (keep FP32)")
        if problems:
            raise ValueError("; ".join(problems))
        return cls(tuple(rules.items()))

    @staticmethod
    def parse(items: Iterable[str]) -> dict[str, Scheme | None]:
        """`PATTERN=SCHEME` strings (`--override re:.*down_proj=int8`) as the ordered map `of` takes; ValueError
        naming every bad item at once."""
        rules: dict[str, Scheme | None] = {}
        problems: list[str] = []
        for item in items:
            pattern, sep, scheme_text = item.partition("=")
            pattern = pattern.strip()
            if not sep or not pattern or not scheme_text.strip():
                problems.append(f"{item!r} is not PATTERN=SCHEME")
            elif (error := _regex_error(pattern)) is not None:
                problems.append(f"{item!r}: bad regex ({error})")
            else:
                try:
                    rules[pattern] = parse_scheme(scheme_text)
                except QpackError as exc:
                    problems.append(f"{item!r}: {exc}")
        if problems:
            raise ValueError("; ".join(problems))
        return rules

    def lookup(self, fqn: str, use_default: bool = True) -> tuple[bool, Scheme | None, str]:
        """(matched, scheme, rule) for one module: exact name > first matching regex > `_default`.

        The LM head is looked up with `use_default=False`: only a rule naming it can force it off FP32.
        """
        for pattern, scheme in self.rules:
            if pattern == fqn:
                return True, scheme, pattern
        for pattern, scheme in self.rules:
            if pattern.startswith(REGEX_PREFIX) and re.fullmatch(pattern[len(REGEX_PREFIX) :], fqn):
                return True, scheme, pattern
        if use_default:
            for pattern, scheme in self.rules:
                if pattern == DEFAULT_KEY:
                    return True, scheme, pattern
        return False, None, ""

    def unmatched_patterns(self, fqns: Iterable[str]) -> list[str]:
        names = list(fqns)
        unused = []
        for pattern, _ in self.rules:
            if pattern == DEFAULT_KEY:
                continue
            if pattern.startswith(REGEX_PREFIX):
                regex = re.compile(pattern[len(REGEX_PREFIX) :])
                if not any(regex.fullmatch(n) for n in names):
                    unused.append(pattern)
            elif pattern not in names:
                unused.append(pattern)
        return unused

    def to_json(self) -> list[dict[str, Any]]:
        return [{"pattern": p, "scheme": None if s is None else s.to_json()} for p, s in self.rules]


@dataclass
class Plan:
    """A concrete plan: every linear of the model with its scheme (None = FP32) and why."""

    shapes: dict[str, tuple[int, int]]
    schemes: dict[str, Scheme | None] = field(default_factory=dict)
    algorithms: dict[str, Algorithm] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def quantized(self) -> dict[str, Scheme]:
        return {fqn: s for fqn, s in self.schemes.items() if s is not None}

    def kept(self) -> list[str]:
        return [fqn for fqn, s in self.schemes.items() if s is None]

    def validate(self) -> None:
        """Every layer whose scheme cannot store it, all at once (grouped by problem), with the fix."""
        problems: dict[str, list[str]] = {}
        for fqn, scheme in self.schemes.items():
            if scheme is None:
                continue
            in_features, out_features = self.shapes[fqn]
            for problem in scheme.problems(in_features, out_features):
                problems.setdefault(f"{scheme.label()}: {problem}", []).append(fqn)
        if problems:
            count = sum(len(v) for v in problems.values())
            details = "; ".join(f"{problem} for {', '.join(fqns)}" for problem, fqns in problems.items())
            raise QpackError(
                f"{count} layers cannot use their planned scheme: {details}; pick a group size that divides "
                "in_features (e.g. int4-g64) or override those layers"
            )

    def bits(self) -> float:
        """Average effective bits per weight over the quantized linears (scales and zero points included)."""
        total = weights = 0.0
        for fqn, scheme in self.quantized().items():
            in_features, out_features = self.shapes[fqn]
            n = in_features * out_features
            total += scheme.bits_per_weight(in_features, out_features) * n
            weights += n
        return total / weights if weights else 0.0

    def summary(self, kept_modules: Iterable[str] = ()) -> str:
        quantized = self.quantized()
        kept = [short_name(f) for f in self.kept()] + list(kept_modules)
        return f"quantized {len(quantized)}/{len(self.schemes)} linears; kept FP32: " + (
            ", ".join(dict.fromkeys(kept)) if kept else "nothing"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            fqn: {
                "scheme": None if scheme is None else scheme.to_json(),
                "algorithm": self.algorithms[fqn].name if fqn in self.algorithms else None,
                "source": self.sources.get(fqn, ""),
                "in_features": self.shapes[fqn][0],
                "out_features": self.shapes[fqn][1],
            }
            for fqn, scheme in self.schemes.items()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        plan = cls(shapes={fqn: (int(v["in_features"]), int(v["out_features"])) for fqn, v in data.items()})
        for fqn, value in data.items():
            plan.schemes[fqn] = None if value["scheme"] is None else Scheme.from_json(value["scheme"])
            if value.get("algorithm"):
                plan.algorithms[fqn] = Algorithm.from_json({"name": value["algorithm"]})
            plan.sources[fqn] = value.get("source", "")
        return plan
