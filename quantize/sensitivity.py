"""Per-layer sensitivity: what each candidate scheme costs each linear, measured, then cached.

For a quantizable linear and a candidate scheme, that layer alone is quantized (with its real runtime module,
so kernel numerics count too) and the KL divergence of next-token distributions from the FP32 model is
measured on held-out calibration tokens. This is the quantity the planner trades against bits; it is
measured rather than guessed because it varies by orders of magnitude between layers of the same type (on
SmolLM2 the last block's down_proj costs 30x more than a middle block's).

Measuring every layer x scheme exactly is a forward pass per candidate, which does not fit a few-minute
budget on a CPU. So the default `kl` method measures KL exactly for each layer's most aggressive candidate
(the one that matters for the decision, e.g. int4 in a mixed plan, int8 in an int8 plan) and derives the
milder candidates of the same layer from it, scaled by the ratio of their output errors on the same tokens
(`tr(dW H dW^T)`, where H is the Gram matrix of the layer's inputs). For the same layer this ratio tracks the
KL ratio within about 2x (measured on SmolLM2), and the milder candidate's KL is ~1% of the aggressive one's,
so the derived value barely moves a decision. `kl-all` measures every candidate; `mse` uses the relative
output error alone (no forward pass per candidate).

Cost is kept down without approximating the measured KL: block inputs of the FP32 model are cached, so a
candidate in block b only re-runs blocks b..L; all candidates of a block run the tail together as one batch;
and the vocabulary projection is chunked. Results are cached in the calibration directory
(`sensitivity.json`), keyed by model weights hash and settings, so re-planning with another budget is instant.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.algorithms import fake_quant, output_error
from quantize.calibdata import SENSITIVITY_FILE
from quantize.errors import QpackError
from quantize.fileio import write_json
from quantize.handlers import handler_for
from quantize.layerwise import (
    LayerwiseModel,
    Pack,
    input_hessians,
    kl_to_reference,
    make_packs,
    reference_logits,
    sample_sequences,
)
from quantize.plan import block_index
from quantize.progress import NULL_PROGRESS, Progress
from quantize.schemes import Scheme
from quantize.surgery import get_module, set_module

METHODS = ("kl", "kl-all", "mse")


def scheme_key(scheme: Scheme) -> str:
    return json.dumps(scheme.to_json(), sort_keys=True)


@dataclass(frozen=True)
class SensitivityConfig:
    method: str = "kl"
    num_tokens: int = 256
    seed: int = 0
    pack_tokens: int = 512

    def cache_key(self, weights_sha256: str) -> str:
        return f"tokens={self.num_tokens}:seed={self.seed}:weights={weights_sha256}"


@dataclass
class SensitivityTable:
    """Per (layer, scheme): the measured KL (when measured) and the relative output error (always)."""

    method: str
    num_tokens: int
    entries: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)

    def entry(self, fqn: str, scheme: Scheme) -> dict[str, float | None] | None:
        return self.entries.get(fqn, {}).get(scheme_key(scheme))

    def record(self, fqn: str, scheme: Scheme, *, kl: float | None = None, mse: float | None = None) -> None:
        slot = self.entries.setdefault(fqn, {}).setdefault(scheme_key(scheme), {"kl": None, "mse": None})
        if kl is not None:
            slot["kl"] = float(kl)
        if mse is not None:
            slot["mse"] = float(mse)

    def value(self, fqn: str, scheme: Scheme) -> tuple[float, str]:
        """(predicted KL, "measured" | "derived") or, for method mse, (relative output error, "mse")."""
        slot = self.entry(fqn, scheme)
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


def _runtime(scheme: Scheme, linear: nn.Linear) -> nn.Module:
    handler = handler_for(scheme)
    tensors = handler.quantize(scheme, linear.weight.detach())
    bias = None if linear.bias is None else linear.bias.detach()
    return handler.build(scheme, tensors, bias, linear.weight.device)


def _measure(
    model: nn.Module,
    todo: dict[str, list[Scheme]],
    measure: dict[str, list[Scheme]],
    packs: list[Pack],
    table: SensitivityTable,
    progress: Progress,
) -> None:
    """Output error for every candidate in `todo`, exact KL for those in `measure`, block by block."""
    lw = LayerwiseModel(model)
    head = lw.lm_head
    blocks = sorted({block_index(f) for f in todo})
    block_inputs: dict[int, list[torch.Tensor]] = defaultdict(list)
    reference = []
    with progress.task("Sensitivity: FP32 reference pass", total=len(packs)) as task:
        for pack in packs:
            hidden = lw.embed(pack)
            for index in range(lw.num_layers):
                if index in blocks:
                    block_inputs[index].append(hidden)
                hidden = lw.run_block(index, hidden, pack)
            reference.append(reference_logits(head, lw.norm(hidden)[0]))
            task.advance()
    num_measured = sum(len(v) for v in measure.values())
    with progress.task(
        f"Sensitivity: {num_measured} exact KL + {sum(len(v) for v in todo.values())} output errors",
        total=len(blocks),
    ) as task:
        for index in blocks:
            fqns = [f for f in todo if block_index(f) == index]
            hessians = input_hessians(
                lw, index, {f: get_module(model, f) for f in fqns}, block_inputs[index], packs
            )
            for fqn in fqns:
                weight = get_module(model, fqn).weight.detach().to(torch.float32)  # type: ignore[union-attr]
                signal = max(float(output_error(weight, hessians[fqn])), 1e-30)
                for scheme in todo[fqn]:
                    error = float(output_error(fake_quant(scheme, weight) - weight, hessians[fqn]))
                    table.record(fqn, scheme, mse=error / signal)
            del hessians
            candidates = [(f, s) for f in fqns for s in measure.get(f, [])]
            if candidates:
                modules = []
                for fqn, scheme in candidates:
                    original = get_module(model, fqn)
                    assert isinstance(original, nn.Linear), fqn
                    modules.append((fqn, original, _runtime(scheme, original)))
                totals = [0.0] * len(candidates)
                count = 0.0
                for pack_index, pack in enumerate(packs):
                    outputs = []
                    for fqn, original, runtime in modules:
                        set_module(model, fqn, runtime)
                        try:
                            outputs.append(lw.run_block(index, block_inputs[index][pack_index], pack))
                        finally:
                            set_module(model, fqn, original)
                    normed = lw.run_from(index + 1, torch.cat(outputs, dim=0), pack)
                    for row in range(len(candidates)):
                        kl = kl_to_reference(head, reference[pack_index], normed[row])
                        totals[row] += float((kl * pack.weights).sum())
                    count += pack.represented_tokens
                for (fqn, scheme), total in zip(candidates, totals, strict=True):
                    table.record(fqn, scheme, kl=total / max(count, 1))
            del block_inputs[index]
            task.advance()
    lw.forget_rope()


def _cache_path(calibration_dir: Path | None) -> Path | None:
    return None if calibration_dir is None else calibration_dir / SENSITIVITY_FILE


def _load_cache(calibration_dir: Path | None, key: str) -> dict[str, dict[str, dict[str, float | None]]]:
    path = _cache_path(calibration_dir)
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data.get("entries", {}).get(key, {})
        return {fqn: {k: dict(v) for k, v in by.items()} for fqn, by in entries.items()}
    except (OSError, json.JSONDecodeError, AttributeError, TypeError):
        return {}


def _save_cache(calibration_dir: Path | None, key: str, table: SensitivityTable) -> None:
    path = _cache_path(calibration_dir)
    if path is None:
        return
    data: dict[str, Any] = {"format": "qpack.sensitivity", "entries": {}}
    if path.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            data = json.loads(path.read_text())
    data.setdefault("entries", {})[key] = table.entries
    write_json(path, data)


def measure_sensitivity(
    model: nn.Module,
    candidates: dict[str, list[Scheme]],
    heldout: list[torch.Tensor],
    config: SensitivityConfig,
    weights_sha256: str,
    calibration_dir: Path | None = None,
    progress: Progress = NULL_PROGRESS,
    load: Callable[[], nn.Module] | None = None,
) -> tuple[SensitivityTable, int]:
    """Sensitivity of every (layer, scheme) in `candidates`; returns the table and the number of cache hits.
    `model` gives the layer shapes (its weights may be on `meta`); `load` returns the model with its weights
    when something must be measured (default: `model` itself)."""
    if config.method not in METHODS:
        raise QpackError(f"--sensitivity must be one of {', '.join(METHODS)} (got {config.method!r})")
    if not heldout:
        raise QpackError(
            "the calibration directory has no held-out tokens; re-run qpack calibrate with --heldout > 0"
        )
    key = config.cache_key(weights_sha256)
    table = SensitivityTable(config.method, config.num_tokens, _load_cache(calibration_dir, key))
    todo: dict[str, list[Scheme]] = {}
    measure: dict[str, list[Scheme]] = {}
    hits = 0
    for fqn, schemes in candidates.items():
        linear = get_module(model, fqn)
        in_features, out_features = int(linear.in_features), int(linear.out_features)
        wanted = to_measure(schemes, in_features, out_features, config.method)
        missing_mse = [s for s in schemes if (table.entry(fqn, s) or {}).get("mse") is None]
        missing_kl = [s for s in wanted if (table.entry(fqn, s) or {}).get("kl") is None]
        hits += len(schemes) - len({scheme_key(s) for s in missing_mse + missing_kl})
        if missing_mse or missing_kl:
            todo[fqn] = list({scheme_key(s): s for s in [*schemes]}.values())
            if missing_kl:
                measure[fqn] = missing_kl
    if todo:
        packs = make_packs(
            sample_sequences(heldout, config.num_tokens, config.seed, truncate=True),
            config.pack_tokens,
            share_prefix=True,
        )
        _measure(load() if load is not None else model, todo, measure, packs, table, progress)
        _save_cache(calibration_dir, key, table)
    return table, hits
