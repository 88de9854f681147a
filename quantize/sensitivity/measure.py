"""Per-layer sensitivity: what each candidate scheme costs each linear, measured, then cached.

For a quantizable linear and a candidate scheme, that layer alone is quantized and the KL divergence of next-token
distributions from the FP32 model is measured on held-out calibration tokens. This is the quantity the planner
trades against bits; it is measured rather than guessed because it varies by orders of magnitude between layers
of the same type (on SmolLM2 the last block's down_proj costs 30x more than a middle block's).

Measuring every layer x scheme exactly is a forward pass per candidate, which does not fit a few-minute budget on
a CPU. So the default `kl` method measures KL exactly for each layer's most aggressive candidate (the one that
matters for the decision, e.g. int4 in a mixed plan, int8 in an int8 plan) and derives the milder candidates of
the same layer from it, scaled by the ratio of their output errors on the same tokens (`tr(dW H dW^T)`, where H is
the Gram matrix of the layer's inputs). For the same layer this ratio tracks the KL ratio within about 2x
(measured on SmolLM2), and the milder candidate's KL is ~1% of the aggressive one's, so the derived value barely
moves a decision. `kl-all` measures every candidate; `mse` uses the relative output error alone (no forward pass
per candidate); `fisher` estimates every candidate from one forward and one backward pass
(`quantize.sensitivity.fisher`), for models where exact KL does not fit the time or memory budget (`auto`
chooses)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from quantize.common.config import Problems
from quantize.common.errors import QpackError
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.formats.schemes import Scheme
from quantize.model.surgery import get_linear
from quantize.planning.plan import block_index
from quantize.sensitivity.exact import measure_exact
from quantize.sensitivity.settings import SensitivityConfig
from quantize.sensitivity.table import (
    FISHER_SLOT,
    SensitivityTable,
    load_cache,
    save_cache,
    scheme_key,
    to_measure,
)
from quantize.sequential.packing import make_packs, sample_sequences
from quantize.sequential.runner import BlockRunner


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
    problems = Problems()
    config.check(problems)
    problems.raise_if_any(config)
    if not heldout:
        raise QpackError(
            "the calibration directory has no held-out tokens; re-run qpack calibrate with --heldout > 0"
        )
    choice = choose_method(model, candidates, config, max_memory)
    method = choice["method"]
    key = config.cache_key(weights_sha256) + (
        f":fisher={config.fisher_samples}" if method == "fisher" else ""
    )
    table = SensitivityTable(method, config.num_tokens, load_cache(calibration_dir, key))
    todo, measure, hits = _missing(model, candidates, table, method, config)
    if todo:
        sample = sample_sequences(heldout, config.num_tokens, config.seed, truncate=True)
        if method == "fisher":
            blocks = BlockRunner(streamed if streamed is not None else model)
            _fisher(blocks, todo, sample, config, table, progress)
        else:
            blocks = BlockRunner(load() if load is not None else model)
            measure_exact(
                blocks,
                todo,
                measure,
                make_packs(sample, config.pack_tokens, share_prefix=True),
                table,
                progress,
            )
        save_cache(calibration_dir, key, table)
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
        in_features, out_features = _features(model, fqn)
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
    blocks: BlockRunner,
    todo: dict[str, list[Scheme]],
    sample: list[torch.Tensor],
    config: SensitivityConfig,
    table: SensitivityTable,
    progress: Progress,
) -> None:
    """Fisher estimates for every candidate; exact KL for the most aggressive candidate of a few layers spread
    over the depth, which sets the estimate's scale (`SensitivityTable.fisher_scale`)."""
    from quantize.sensitivity.fisher import fisher_kl

    packs = make_packs(sample, config.pack_tokens, share_prefix=False)
    estimates = fisher_kl(blocks, todo, packs, config.fisher_samples, config.seed, progress)
    for fqn, values in estimates.items():
        for scheme, value in zip(todo[fqn], values, strict=True):
            table.record(fqn, scheme, fisher=value)
    names = list(todo)
    if config.calibration_layers <= 0 or not names:
        return
    step = max(1, len(names) // config.calibration_layers)
    chosen = names[step // 2 :: step][: config.calibration_layers]
    measure = {fqn: to_measure(todo[fqn], *_features(blocks.model, fqn), "kl")[:1] for fqn in chosen}
    measure_exact(
        blocks,
        {f: todo[f] for f in chosen},
        measure,
        make_packs(sample, config.pack_tokens, share_prefix=True),
        table,
        progress,
    )


def _features(model: nn.Module, fqn: str) -> tuple[int, int]:
    linear = get_linear(model, fqn)
    return linear.in_features, linear.out_features


def choose_method(
    model: nn.Module, candidates: dict[str, list[Scheme]], config: SensitivityConfig, max_memory: int | None
) -> dict[str, Any]:
    """`auto`: exact KL where its estimated time fits the budget and the whole model fits memory in FP32, else
    Fisher. The estimate: each measured candidate re-runs the blocks after its own on `num_tokens` tokens, at
    2 FLOPs per weight per token, at the matrix-multiply rate measured here."""
    if config.method != "auto":
        return {"method": config.method, "reason": "asked for"}
    blocks = len(cast(Any, model).model.layers)
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
        "" if fits else f"; the FP32 model ({model_bytes / 2**30:.1f} GiB) does not fit the memory limit"
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
