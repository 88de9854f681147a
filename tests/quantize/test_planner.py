from __future__ import annotations

import itertools
import random

import pytest

from quantize.formats.schemes import BF16, Int4, Int8
from quantize.planning.knapsack import Infeasible, Option, solve


def _random_layers(rng: random.Random, count: int) -> dict[str, list[Option]]:
    layers = {}
    for i in range(count):
        n = rng.choice([1000, 4000, 9000])
        kl4 = rng.uniform(1e-4, 1e-1)
        layers[f"l{i}"] = [
            Option(Int4(64), 4.375 * n, kl4),
            Option(Int8(), 8.05 * n, kl4 * rng.uniform(0.002, 0.05)),
            Option(BF16(), 16.0 * n, 0.0),
        ]
    return layers


def _brute_force(layers: dict[str, list[Option]], budget: float) -> float:
    best = float("inf")
    for combo in itertools.product(*layers.values()):
        if sum(o.bits for o in combo) <= budget:
            best = min(best, sum(o.kl for o in combo))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers = _random_layers(rng, 6)
    floor = sum(o[0].bits for o in layers.values())
    top = sum(o[-1].bits for o in layers.values())
    budget = rng.uniform(floor, top)
    chosen, predicted = solve(layers, budget_bits=budget, resolution=50_000)
    assert sum(o.bits for o in chosen.values()) <= budget + 1e-6
    assert predicted == pytest.approx(sum(o.kl for o in chosen.values()))
    optimum = _brute_force(layers, budget)
    assert predicted <= optimum * 1.02 + 1e-12


def test_budget_at_the_floor_is_feasible_and_below_is_impossible() -> None:
    layers = _random_layers(random.Random(9), 5)
    floor = sum(o[0].bits for o in layers.values())
    chosen, _ = solve(layers, budget_bits=floor)
    assert all(o.scheme == Int4(64) for o in chosen.values())
    with pytest.raises(Infeasible, match="is an impossible size budget"):
        solve(layers, budget_bits=floor * 0.9)


def test_max_kl_mode_picks_cheapest_plan_within_the_limit() -> None:
    layers = _random_layers(random.Random(3), 5)
    all_int4 = sum(o[0].kl for o in layers.values())
    chosen, predicted = solve(layers, max_kl=all_int4 / 4)
    assert predicted <= all_int4 / 4
    cost = sum(o.bits for o in chosen.values())
    for combo in itertools.product(*layers.values()):
        if sum(o.kl for o in combo) <= all_int4 / 4:
            assert sum(o.bits for o in combo) >= cost * 0.995
    with pytest.raises(Infeasible, match="is an impossible KL budget"):
        solve({"a": [Option(Int4(64), 10.0, 0.5)]}, max_kl=0.1)
