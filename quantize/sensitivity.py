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
import time
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
    ReferenceLogits,
    input_hessians,
    kl_to_reference,
    make_packs,
    reference_logits,
    sample_sequences,
)
from quantize.plan import block_index
from quantize.progress import NULL_PROGRESS, Progress
from quantize.schemes import Scheme
from quantize.surgery import get_module, input_groups, set_module

METHODS = ("auto", "kl", "kl-all", "fisher", "mse")


FISHER_SLOT = "fisher"


def scheme_key(scheme: Scheme) -> str:
    return json.dumps(scheme.to_json(), sort_keys=True)


@dataclass(frozen=True)
class SensitivityConfig:
    # auto: exact KL (`kl`) where its estimated time fits `budget_minutes` and the whole model fits memory,
    # else the Fisher estimate (`fisher`, quantize/fisher.py) scaled by exact KL on `calibration_layers` layers
    method: str = "auto"
    num_tokens: int = 256
    seed: int = 0
    pack_tokens: int = 512
    budget_minutes: float = 10.0
    fisher_samples: int = 4
    calibration_layers: int = 4

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


def _runtime(scheme: Scheme, linear: nn.Linear) -> nn.Module:
    handler = handler_for(scheme)
    tensors = handler.quantize(scheme, linear.weight.detach())
    bias = None if linear.bias is None else linear.bias.detach()
    return handler.build(scheme, tensors, bias, linear.weight.device)


def _measure(
    lw: LayerwiseModel,
    todo: dict[str, list[Scheme]],
    measure: dict[str, list[Scheme]],
    packs: list[Pack],
    table: SensitivityTable,
    progress: Progress,
) -> None:
    """Output error for every candidate in `todo`, exact KL for those in `measure`, block by block."""
    head = lw.lm_head
    blocks = sorted({block_index(f) for f in todo})
    block_inputs: dict[int, list[torch.Tensor]] = defaultdict(list)
    with (
        progress.task("Sensitivity: FP32 reference pass", total=lw.num_layers) as task,
        torch.inference_mode(),
    ):
        hidden = [lw.embed(p) for p in packs]
        for index in range(lw.num_layers):
            if index in blocks:
                block_inputs[index] = hidden
            with lw.block(index):
                hidden = [lw.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
            task.advance()
        reference = [reference_logits(head, lw.norm(h)[0]) for h in hidden]
    num_measured = sum(len(v) for v in measure.values())
    with progress.task(
        f"Sensitivity: {num_measured} exact KL + {sum(len(v) for v in todo.values())} output errors",
        total=len(blocks),
    ) as task:
        for index in blocks:
            with lw.block(index):
                _measure_block(lw, index, todo, measure, packs, block_inputs[index], reference, table)
            del block_inputs[index]
            task.advance()
    lw.forget_rope()


def _measure_block(
    lw: LayerwiseModel,
    index: int,
    todo: dict[str, list[Scheme]],
    measure: dict[str, list[Scheme]],
    packs: list[Pack],
    inputs: list[torch.Tensor],
    reference: list[ReferenceLogits],
    table: SensitivityTable,
) -> None:
    """One block's candidates: output errors from its input Hessians, then exact KL of the measured ones."""
    model = lw.model
    fqns = [f for f in todo if block_index(f) == index]
    groups = {m: g.name for g in input_groups(model) if g.block == index for m in g.members}
    heads = {g.name: get_module(model, g.members[0]) for g in input_groups(model) if g.block == index}
    hessians = input_hessians(
        lw, index, heads, inputs, packs
    )  # one per input: q/k/v and gate/up share theirs
    for fqn in fqns:
        weight = get_module(model, fqn).weight.detach().to(torch.float32)  # type: ignore[union-attr]
        hessian = hessians[groups[fqn]]
        signal = max(float(output_error(weight, hessian)), 1e-30)
        for scheme in todo[fqn]:
            error = float(output_error(fake_quant(scheme, weight) - weight, hessian))
            table.record(fqn, scheme, mse=error / signal)
    del hessians
    candidates = [(f, s) for f in fqns for s in measure.get(f, [])]
    if candidates:
        _exact_kl(lw, index, candidates, packs, inputs, reference, table)


def _exact_kl(
    lw: LayerwiseModel,
    index: int,
    candidates: list[tuple[str, Scheme]],
    packs: list[Pack],
    inputs: list[torch.Tensor],
    reference: list[ReferenceLogits],
    table: SensitivityTable,
) -> None:
    """KL from FP32 with each candidate alone in place, re-running the tail (all candidates as one batch)."""
    model, head = lw.model, lw.lm_head
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
                outputs.append(lw.run_block(index, inputs[pack_index], pack))
            finally:
                set_module(model, fqn, original)
        normed = lw.run_from(index + 1, torch.cat(outputs, dim=0), pack)
        for row in range(len(candidates)):
            kl = kl_to_reference(head, reference[pack_index], normed[row])
            totals[row] += float((kl * pack.weights).sum())
        count += pack.represented_tokens
    for (fqn, scheme), total in zip(candidates, totals, strict=True):
        table.record(fqn, scheme, kl=total / max(count, 1))


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
    streamed: nn.Module | Any | None = None,
    max_memory: int | None = None,
) -> tuple[SensitivityTable, int, dict[str, Any]]:
    """Sensitivity of every (layer, scheme) in `candidates`; returns the table, the number of cache hits and
    how the method was chosen. `model` gives the layer shapes (its weights may be on `meta`); `load` returns the
    whole model with its weights (exact methods); `streamed` is what the Fisher pass walks block by block."""
    if config.method not in METHODS:
        raise QpackError(f"--sensitivity must be one of {', '.join(METHODS)} (got {config.method!r})")
    if not heldout:
        raise QpackError(
            "the calibration directory has no held-out tokens; re-run qpack calibrate with --heldout > 0"
        )
    choice = choose_method(model, candidates, config, max_memory)
    method = choice["method"]
    key = config.cache_key(weights_sha256) + (
        f":fisher={config.fisher_samples}" if method == "fisher" else ""
    )
    table = SensitivityTable(method, config.num_tokens, _load_cache(calibration_dir, key))
    todo, measure, hits = _missing(model, candidates, table, method, config)
    if todo:
        sample = sample_sequences(heldout, config.num_tokens, config.seed, truncate=True)
        if method == "fisher":
            lw = LayerwiseModel(streamed if streamed is not None else model)
            _fisher(lw, todo, sample, config, table, progress)
        else:
            lw = LayerwiseModel(load() if load is not None else model)
            _measure(
                lw, todo, measure, make_packs(sample, config.pack_tokens, share_prefix=True), table, progress
            )
        _save_cache(calibration_dir, key, table)
    return table, hits, choice


def _missing(
    model: nn.Module,
    candidates: dict[str, list[Scheme]],
    table: SensitivityTable,
    method: str,
    config: SensitivityConfig,
) -> tuple[dict[str, list[Scheme]], dict[str, list[Scheme]], int]:
    """(candidates to compute, those to measure exactly, cache hits) given what the cached table holds."""
    todo: dict[str, list[Scheme]] = {}
    measure: dict[str, list[Scheme]] = {}
    hits = 0
    for fqn, schemes in candidates.items():
        linear = get_module(model, fqn)
        in_features, out_features = int(linear.in_features), int(linear.out_features)
        if method == "fisher":
            missing = [s for s in schemes if (table.entry(fqn, s) or {}).get(FISHER_SLOT) is None]
            hits += len(schemes) - len(missing)
            if missing:
                todo[fqn] = list(schemes)
            continue
        wanted = to_measure(schemes, in_features, out_features, method)
        missing_mse = [s for s in schemes if (table.entry(fqn, s) or {}).get("mse") is None]
        missing_kl = [s for s in wanted if (table.entry(fqn, s) or {}).get("kl") is None]
        hits += len(schemes) - len({scheme_key(s) for s in missing_mse + missing_kl})
        if missing_mse or missing_kl:
            todo[fqn] = list({scheme_key(s): s for s in [*schemes]}.values())
            if missing_kl:
                measure[fqn] = missing_kl
    return todo, measure, hits


def _fisher(
    lw: LayerwiseModel,
    todo: dict[str, list[Scheme]],
    sample: list[torch.Tensor],
    config: SensitivityConfig,
    table: SensitivityTable,
    progress: Progress,
) -> None:
    """Fisher estimates for every candidate; exact KL for the most aggressive candidate of a few layers spread
    over the depth, which sets the estimate's scale (`SensitivityTable.fisher_scale`)."""
    from quantize.fisher import fisher_kl

    packs = make_packs(sample, config.pack_tokens, share_prefix=False)
    estimates = fisher_kl(lw, todo, packs, config.fisher_samples, config.seed, progress)
    for fqn, values in estimates.items():
        for scheme, value in zip(todo[fqn], values, strict=True):
            table.record(fqn, scheme, fisher=value)
    names = list(todo)
    if config.calibration_layers <= 0 or not names:
        return
    step = max(1, len(names) // config.calibration_layers)
    chosen = names[step // 2 :: step][: config.calibration_layers]
    measure = {fqn: to_measure(todo[fqn], *_features(lw.model, fqn), "kl")[:1] for fqn in chosen}
    _measure(
        lw,
        {f: todo[f] for f in chosen},
        measure,
        make_packs(sample, config.pack_tokens, share_prefix=True),
        table,
        progress,
    )


def _features(model: nn.Module, fqn: str) -> tuple[int, int]:
    linear = get_module(model, fqn)
    return int(linear.in_features), int(linear.out_features)


def choose_method(
    model: nn.Module, candidates: dict[str, list[Scheme]], config: SensitivityConfig, max_memory: int | None
) -> dict[str, Any]:
    """`auto`: exact KL where its estimated time fits the budget and the whole model fits memory in FP32, else
    Fisher. The estimate: each measured candidate re-runs the blocks after its own on `num_tokens` tokens, at
    2 FLOPs per weight per token, at the matrix-multiply rate measured here."""
    if config.method != "auto":
        return {"method": config.method, "reason": "asked for"}
    blocks = len(model.model.layers)  # type: ignore[union-attr]
    per_block = sum(
        _features(model, n)[0] * _features(model, n)[1]
        for n, m in model.named_modules()
        if n.startswith("model.layers.0.") and isinstance(m, nn.Linear)
    )
    flops = 0.0
    for fqn, schemes in candidates.items():
        tail = blocks - block_index(fqn)
        flops += (
            len(to_measure(schemes, *_features(model, fqn), "kl"))
            * tail
            * 2.0
            * per_block
            * config.num_tokens
        )
    seconds = flops / _matmul_flops_per_second()
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    fits = max_memory is None or model_bytes < 0.8 * max_memory
    exact = seconds <= 60 * config.budget_minutes and fits
    reason = f"exact KL estimated at {seconds / 60:.1f} min (budget {config.budget_minutes:g} min)" + (
        "" if fits else f"; the FP32 model ({model_bytes / 2**30:.1f} GiB) does not fit --max-memory"
    )
    return {
        "method": "kl" if exact else "fisher",
        "reason": reason,
        "exact_kl_minutes": round(seconds / 60, 2),
    }


def _matmul_flops_per_second() -> float:
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    started = time.perf_counter()
    for _ in range(8):
        torch.mm(a, b)
    return 8 * 2 * 256 * 1024 * 1024 / max(time.perf_counter() - started, 1e-9)
