"""The plan, resolved before any weight changes: overrides first, then the preset's candidates for the layers left
free, uniformly or (under a size or KL budget) by measured sensitivity and the exact knapsack.

A size budget below what the candidates can reach is refused before any sensitivity is measured; a preset's
budget below this model's floor (some layers cannot take the cheapest scheme) is raised to it, with a warning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from quantize.algorithms import algorithm_for
from quantize.common.config import ConfigError, Problem
from quantize.common.memory import available_memory
from quantize.common.progress import Progress
from quantize.config import QuantizeConfig
from quantize.formats.schemes import Int8, Scheme
from quantize.io.calibration import CalibrationData
from quantize.model.surgery import linear_shapes
from quantize.planning.knapsack import Infeasible, Option, solve
from quantize.planning.plan import EMBEDDING_NAMES, Plan, is_decoder_linear
from quantize.sensitivity.measure import measure_sensitivity
from quantize.sensitivity.table import SensitivityTable
from quantize.sequential.streamed import StreamedModel


def build_plan(
    config: QuantizeConfig,
    model: nn.Module,
    calibration: CalibrationData,
    weights_sha: str,
    progress: Progress,
    warnings: list[str],
    load: Callable[[], nn.Module] | None = None,
    streamed: StreamedModel | None = None,
) -> tuple[Plan, SensitivityTable | None, list[Scheme], dict[str, Any]]:
    """The plan, resolved before any weight changes: overrides first, then the preset's candidates for the
    layers left free, uniformly or (under a size or KL budget) by measured sensitivity and the exact knapsack.
    A size budget below what the candidates can reach is refused before any sensitivity is measured."""
    shapes = linear_shapes(model)
    plan, free = _apply_rules(config, shapes, warnings)
    candidates = config.candidates()
    per_layer = _layer_candidates(free, shapes, candidates, warnings)
    target_bits = config.resolved_target_bits()
    info: dict[str, Any] = {"candidates": [s.label() for s in candidates], "target_bits": target_bits}
    table: SensitivityTable | None = None
    if all(len(v) == 1 for v in per_layer.values()) or (target_bits is None and config.max_kl is None):
        for fqn in free:
            in_features, out_features = shapes[fqn]
            plan.schemes[fqn] = min(
                per_layer[fqn], key=lambda s: s.bits_per_weight(in_features, out_features)
            )
            plan.sources[fqn] = f"preset {config.preset.name}"
        info["planner"] = "uniform"
    else:
        if config.max_kl is None:
            assert target_bits is not None
            target_bits = _reachable_target(config, plan, per_layer, target_bits, warnings)
            info["target_bits"] = target_bits
        table, info["sensitivity_cache_hits"], info["sensitivity"] = measure_sensitivity(
            model,
            per_layer,
            calibration.heldout,
            config.sensitivity,
            weights_sha,
            calibration.path,
            progress,
            load,
            streamed,
            config.max_memory if config.max_memory is not None else int(0.9 * available_memory()),
        )
        _solve_budget(config, plan, per_layer, table, target_bits, info)
    for fqn, scheme in plan.schemes.items():
        if scheme is not None:
            plan.algorithms[fqn] = algorithm_for(scheme, config.algorithm)
    plan.validate()
    return plan, table, candidates, info


def _apply_rules(
    config: QuantizeConfig, shapes: dict[str, tuple[int, int]], warnings: list[str]
) -> tuple[Plan, list[str]]:
    """The plan with every override applied and the head kept; the decoder linears left for the planner."""
    rules = config.rules()
    unmatched = rules.unmatched_patterns(shapes)
    embedding_hits = [p for p in unmatched if any(e in p for e in EMBEDDING_NAMES)]
    if embedding_hits:
        raise ConfigError(
            "QuantizeConfig",
            [
                Problem(
                    "overrides",
                    f"{', '.join(embedding_hits)}: embeddings are not linears and always stay FP32",
                )
            ],
        )
    if unmatched:
        raise ConfigError(
            "QuantizeConfig",
            [
                Problem(
                    "overrides",
                    f"pattern(s) {', '.join(unmatched)} match no linear layer of this model (names look like "
                    "model.layers.0.mlp.down_proj; prefix regexes with re:)",
                )
            ],
        )
    plan = Plan(shapes=shapes)
    free: list[str] = []
    for fqn in shapes:
        matched, scheme, rule = rules.lookup(fqn, use_default=is_decoder_linear(fqn))
        if matched:
            plan.schemes[fqn] = scheme
            plan.sources[fqn] = f"override {rule}"
            if not is_decoder_linear(fqn) and scheme is not None:
                warnings.append(
                    f"{fqn} forced to {scheme.label()} by override {rule!r}; it is normally kept FP32"
                )
        elif is_decoder_linear(fqn):
            free.append(fqn)
        else:
            plan.schemes[fqn] = None
            plan.sources[fqn] = "kept (head)"
    return plan, free


def _layer_candidates(
    free: list[str], shapes: dict[str, tuple[int, int]], candidates: list[Scheme], warnings: list[str]
) -> dict[str, list[Scheme]]:
    """The candidate schemes each free layer's shape allows (int8 where none does)."""
    per_layer: dict[str, list[Scheme]] = {}
    fallbacks: list[str] = []
    for fqn in free:
        valid = [s for s in candidates if not s.problems(*shapes[fqn])]
        if not valid:
            valid = [Int8()]
            fallbacks.append(fqn)
        per_layer[fqn] = valid
    if fallbacks:
        warnings.append(
            f"{len(fallbacks)} layers cannot use any candidate scheme (e.g. {fallbacks[0]} with in_features "
            f"{shapes[fallbacks[0]][0]}); they fall back to int8"
        )
    return per_layer


def _weights(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def _fixed_bits(plan: Plan) -> tuple[float, int]:
    """Storage bits and weights of the linears the rules already fixed to a scheme."""
    bits, weights = 0.0, 0
    for fqn, scheme in plan.schemes.items():
        if scheme is not None:
            bits += scheme.bits_per_weight(*plan.shapes[fqn]) * _weights(plan.shapes[fqn])
            weights += _weights(plan.shapes[fqn])
    return bits, weights


def _reachable_target(
    config: QuantizeConfig,
    plan: Plan,
    per_layer: dict[str, list[Scheme]],
    target_bits: float,
    warnings: list[str],
) -> float:
    """The size budget in bits per weight, checked against the range the candidates can reach (which depends
    on layer shapes only): an explicit `target_bits` below it is an error, a preset's budget is raised to it."""
    fixed_bits, fixed_weights = _fixed_bits(plan)
    total = fixed_weights + sum(_weights(plan.shapes[f]) for f in per_layer)
    cheapest = {f: min(s.bits_per_weight(*plan.shapes[f]) for s in v) for f, v in per_layer.items()}
    dearest = {f: max(s.bits_per_weight(*plan.shapes[f]) for s in v) for f, v in per_layer.items()}
    floor = (fixed_bits + sum(cheapest[f] * _weights(plan.shapes[f]) for f in per_layer)) / total
    ceiling = (fixed_bits + sum(dearest[f] * _weights(plan.shapes[f]) for f in per_layer)) / total
    if target_bits >= floor:
        return target_bits
    if config.target_bits is not None:
        message = (
            f"{target_bits} is an impossible size budget: these layers need at least {floor:.3f} bits per weight with "
            f"the cheapest candidate schemes (reachable: {floor:.3f} to {ceiling:.3f}); raise it or add cheaper "
            "candidate schemes"
        )
        raise ConfigError("QuantizeConfig", [Problem("target_bits", message)])
    warnings.append(
        f"the {config.preset.name} preset's {target_bits}-bit budget is below this model's floor of "
        f"{floor:.3f} bits (some layers cannot use the cheapest scheme); using {floor:.3f}"
    )
    return floor


def _solve_budget(
    config: QuantizeConfig,
    plan: Plan,
    per_layer: dict[str, list[Scheme]],
    table: SensitivityTable,
    target_bits: float | None,
    info: dict[str, Any],
) -> None:
    """Each free layer's scheme from the exact knapsack over measured sensitivity, under `max_kl` (fewest bits)
    or the size budget (least predicted KL)."""
    layers = {
        fqn: [
            Option(
                s, s.bits_per_weight(*plan.shapes[fqn]) * _weights(plan.shapes[fqn]), table.value(fqn, s)[0]
            )
            for s in schemes
        ]
        for fqn, schemes in per_layer.items()
    }
    try:
        if config.max_kl is not None:
            chosen, predicted = solve(layers, max_kl=config.max_kl)
        else:
            assert target_bits is not None
            fixed_bits, fixed_weights = _fixed_bits(plan)
            total = fixed_weights + sum(_weights(plan.shapes[f]) for f in per_layer)
            chosen, predicted = solve(layers, budget_bits=target_bits * total - fixed_bits + 1e-6)
    except Infeasible as error:
        field = "max_kl" if config.max_kl is not None else "target_bits"
        raise ConfigError("QuantizeConfig", [Problem(field, str(error))]) from None
    for fqn, option in chosen.items():
        plan.schemes[fqn] = option.scheme
        plan.sources[fqn] = "planner"
    info["planner"] = "exact knapsack (DP)"
    info["predicted_kl"] = predicted
    info["budget"] = {"max_kl": config.max_kl} if config.max_kl is not None else {"target_bits": target_bits}
