"""Choose each layer's scheme to minimise predicted KL under a size budget (or bits under a KL budget).

This is a multiple-choice knapsack: every layer picks exactly one candidate (a scheme with a storage cost in
bits and a predicted KL), the total cost must fit the budget, and the total predicted KL (per-layer KLs add
up, to first order, for independent small perturbations) is minimised.

We solve it exactly by dynamic programming over the cost axis rather than greedily. Greedy "best marginal KL
per saved bit" is optimal only on the convex hull of each layer's options and can strand budget when a large
layer's upgrade does not fit; with ~200 layers and a few options each, the DP over a cost axis discretised into
`resolution` steps is a few million vectorised operations (milliseconds). Costs are rounded *up* to a step,
so the plan never exceeds the budget; the only approximation is that rounding, at most one step per layer.
A KL budget (`max_kl`) uses the same table: the cheapest cost whose minimal KL is within the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quantize.formats.schemes import Scheme


@dataclass(frozen=True)
class Option:
    scheme: Scheme
    bits: float  # total storage bits of the layer with this scheme
    kl: float  # predicted KL contribution


class Infeasible(ValueError):
    """No choice of options meets the budget; the message says by how much and what to change."""


def solve(
    layers: dict[str, list[Option]],
    *,
    budget_bits: float | None = None,
    max_kl: float | None = None,
    resolution: int = 20_000,
) -> tuple[dict[str, Option], float]:
    """Pick one option per layer. Exactly one of `budget_bits` / `max_kl` must be given.

    Returns ({fqn: option}, predicted total KL).
    """
    if (budget_bits is None) == (max_kl is None):
        raise ValueError("give exactly one of budget_bits or max_kl")
    names = list(layers)
    if not names:
        return {}, 0.0
    missing = [name for name in names if not layers[name]]
    if missing:
        raise ValueError(f"layers without a candidate option: {', '.join(missing)}")
    floor = {n: min(o.bits for o in layers[n]) for n in names}
    min_cost = sum(floor.values())
    max_extra = sum(max(o.bits for o in layers[n]) - floor[n] for n in names)
    if budget_bits is not None and budget_bits < min_cost * (1 - 1e-9):
        raise Infeasible(
            f"is an impossible size budget: these layers need at least {min_cost / 8 / 2**20:.3f} MiB with the "
            f"cheapest candidates, the budget allows {budget_bits / 8 / 2**20:.3f} MiB; raise it"
        )
    # Costs are measured above each layer's cheapest option, so the all-cheapest plan costs exactly 0 and is
    # always representable; rounding only touches upgrades.
    ceiling = max_extra if budget_bits is None else min(max(budget_bits - min_cost, 0.0), max_extra)
    unit = max(ceiling / resolution, 1e-9)
    size = resolution + 1

    def units(name: str, option: Option) -> int:
        return math.ceil((option.bits - floor[name]) / unit - 1e-9)

    dp = np.zeros(size, dtype=np.float64)
    back = np.zeros((len(names), size), dtype=np.int16)
    for row, name in enumerate(names):
        best = np.full(size, np.inf)
        arg = np.zeros(size, dtype=np.int16)
        for index, option in enumerate(layers[name]):
            cost = units(name, option)
            if cost >= size:
                continue
            shifted = np.full(size, np.inf)
            shifted[cost:] = dp[: size - cost] + option.kl
            better = shifted < best
            best[better] = shifted[better]
            arg[better] = index
        dp, back[row] = best, arg
    if budget_bits is not None:
        end = size - 1
        if not np.isfinite(dp[end]):
            raise Infeasible("is an impossible size budget after rounding; raise it slightly")
    else:
        assert max_kl is not None
        feasible = np.nonzero(dp <= max_kl)[0]
        if feasible.size == 0:
            best_kl = float(np.min(dp))
            raise Infeasible(
                f"{max_kl} is an impossible KL budget: even the most precise candidates predict KL {best_kl:.4g}; "
                "raise it or add a more precise candidate scheme (e.g. bf16)"
            )
        end = int(feasible[0])
    total = float(dp[end])
    chosen: dict[str, Option] = {}
    cost_left = end
    for row in range(len(names) - 1, -1, -1):
        option = layers[names[row]][int(back[row, cost_left])]
        chosen[names[row]] = option
        cost_left -= units(names[row], option)
    assert cost_left >= 0
    return dict(reversed(list(chosen.items()))), total
