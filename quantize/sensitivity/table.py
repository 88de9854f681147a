"""The sensitivity table: per (layer, scheme) the measured KL, the relative output error and the Fisher estimate,
and the value the planner trades against bits; cached in the calibration directory.

The planner needs one number per candidate. Where KL was measured it is that; a milder candidate of the same
layer is derived from the layer's measured one, scaled by the ratio of their output errors; under the Fisher
method the estimate, corrected by the median ratio of exact to estimated KL on the layers measured both ways.
The cache (`sensitivity.json` beside the calibration data) is keyed by the model's weights hash and the
settings, so re-planning with another budget measures nothing."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize.common.fileio import write_json
from quantize.formats.schemes import Scheme
from quantize.io.calibration import SENSITIVITY_FILE

FISHER_SLOT = "fisher"


def scheme_key(scheme: Scheme) -> str:
    return json.dumps(scheme.to_json(), sort_keys=True)


@dataclass
class SensitivityTable:
    """Per (layer, scheme): the measured KL (when measured) and the relative output error (always)."""

    method: str
    num_tokens: int
    entries: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)

    def entry(self, fqn: str, scheme: Scheme) -> dict[str, float | None] | None:
        return self.entries.get(fqn, {}).get(scheme_key(scheme))

    def record(
        self,
        fqn: str,
        scheme: Scheme,
        *,
        kl: float | None = None,
        mse: float | None = None,
        fisher: float | None = None,
    ) -> None:
        slot = self.entries.setdefault(fqn, {}).setdefault(scheme_key(scheme), {"kl": None, "mse": None})
        for name, value in (("kl", kl), ("mse", mse), (FISHER_SLOT, fisher)):
            if value is not None:
                slot[name] = float(value)

    def fisher_scale(self) -> float:
        """Median of exact KL / Fisher estimate over the pairs measured both ways (1 without any), within
        [0.1, 10]: the second-order estimate already has KL's units, so this corrects only its bias."""
        ratios = sorted(
            float(v["kl"]) / float(v[FISHER_SLOT])  # type: ignore[arg-type]
            for by in self.entries.values()
            for v in by.values()
            if v.get("kl") is not None and v.get(FISHER_SLOT)
        )
        return min(10.0, max(0.1, ratios[len(ratios) // 2])) if ratios else 1.0

    def value(self, fqn: str, scheme: Scheme) -> tuple[float, str]:
        """(predicted KL, "measured" | "derived" | "fisher") or, for method mse, (relative error, "mse")."""
        slot = self.entry(fqn, scheme)
        if self.method == "fisher" and slot is not None:
            if slot.get("kl") is not None:
                return float(slot["kl"]), "measured"  # type: ignore[arg-type]
            if slot.get(FISHER_SLOT) is not None:
                return self.fisher_scale() * float(slot[FISHER_SLOT]), "fisher"  # type: ignore[arg-type]
        if slot is None or slot.get("mse") is None:
            raise KeyError((fqn, scheme_key(scheme)))
        mse = float(slot["mse"])  # type: ignore[arg-type]
        if self.method == "mse":
            return mse, "mse"
        if slot.get("kl") is not None:
            return float(slot["kl"]), "measured"  # type: ignore[arg-type]
        anchors = [
            (float(v["kl"]), float(v["mse"]))  # type: ignore[arg-type]
            for v in self.entries.get(fqn, {}).values()
            if v.get("kl") is not None and v.get("mse")
        ]
        if not anchors:
            raise KeyError((fqn, scheme_key(scheme)))
        anchor_kl, anchor_mse = max(anchors, key=lambda a: a[1])
        return anchor_kl * mse / max(anchor_mse, 1e-30), "derived"

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for fqn, by_scheme in self.entries.items():
            for key, slot in by_scheme.items():
                scheme = Scheme.from_json(json.loads(key))
                value, how = self.value(fqn, scheme)
                out.append({"module": fqn, "scheme": scheme.label(), "value": value, "how": how, **slot})
        return out


def to_measure(schemes: list[Scheme], in_features: int, out_features: int, method: str) -> list[Scheme]:
    """Which candidates get an exact KL: all (kl-all), none (mse), or the sub-8-bit ones / the smallest."""
    if method == "kl-all":
        return list(schemes)
    if method == "mse":
        return []
    aggressive = [s for s in schemes if s.bits_per_weight(in_features, out_features) < 8.0]
    if aggressive:
        return aggressive
    return [min(schemes, key=lambda s: s.bits_per_weight(in_features, out_features))]


def cache_path(calibration_dir: Path | None) -> Path | None:
    return None if calibration_dir is None else calibration_dir / SENSITIVITY_FILE


def load_cache(calibration_dir: Path | None, key: str) -> dict[str, dict[str, dict[str, float | None]]]:
    path = cache_path(calibration_dir)
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data.get("entries", {}).get(key, {})
        return {fqn: {k: dict(v) for k, v in by.items()} for fqn, by in entries.items()}
    except (OSError, json.JSONDecodeError, AttributeError, TypeError):
        return {}


def save_cache(calibration_dir: Path | None, key: str, table: SensitivityTable) -> None:
    path = cache_path(calibration_dir)
    if path is None:
        return
    data: dict[str, Any] = {"format": "qpack.sensitivity", "entries": {}}
    if path.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            data = json.loads(path.read_text())
    data.setdefault("entries", {})[key] = table.entries
    write_json(path, data)
