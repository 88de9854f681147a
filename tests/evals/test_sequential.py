"""The sequential gate's error control, checked by simulation against a known population."""

from __future__ import annotations

import numpy as np
import pytest

from evals.sequential import GateSequence, WoRConfidenceSequence, decide

GATE_POINTS = 1.0


def population(size: int, flips_each_way: float, extra_drop: float) -> np.ndarray:
    """Per-question accuracy differences (artifact - reference) in {-1, 0, 1}, as CS inputs (d + 1) / 2."""
    d = np.zeros(size)
    k = round(flips_each_way * size)
    d[:k] = 1
    d[k : 2 * k + round(extra_drop * size)] = -1
    return (d + 1) / 2


def simulate_passes(x: np.ndarray, runs: int, seed: int, naive: bool = False) -> tuple[float, float]:
    """(false-pass rate, rate of runs whose interval ever excluded the true mean) over RUNS random orders."""
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((runs, x.size)), axis=1)
    mu = x.mean()
    cs = WoRConfidenceSequence(x.size, 0.05, runs)
    passed = np.zeros(runs, dtype=bool)
    missed = np.zeros(runs, dtype=bool)
    total, squares = np.zeros(runs), np.zeros(runs)
    for t in range(x.size):
        value = x[order[:, t]]
        if naive:  # a 95% normal CI recomputed after every question: what a sequential gate must not be
            total += value
            squares += value**2
            n = t + 1
            mean = total / n
            half = 1.96 * np.sqrt(np.maximum(squares / n - mean**2, 1e-12) / n) if n > 1 else np.ones(runs)
            lower, upper = mean - half, mean + half
        else:
            cs.update(value)
            lower, upper = cs.lower, cs.upper
        missed |= (lower > mu + 1e-12) | (upper < mu - 1e-12)
        drop_high = 100 * (1 - 2 * lower)
        passed |= drop_high <= GATE_POINTS
    return float(passed.mean()), float(missed.mean())


def test_false_pass_rate_just_above_the_gate_stays_under_the_level() -> None:
    x = population(2000, flips_each_way=0.04, extra_drop=0.012)  # true drop 1.2 points, gate 1.0
    assert 100 * (1 - 2 * x.mean()) == pytest.approx(1.2)
    false_pass, missed = simulate_passes(x, runs=3000, seed=0)
    assert false_pass <= 0.025  # one-sided half of alpha = 0.05
    assert missed <= 0.05


def test_the_same_harness_catches_repeated_naive_intervals() -> None:
    """Peeking at a fixed-sample CI after every question passes the gate far more often than 2.5%."""
    x = population(2000, flips_each_way=0.04, extra_drop=0.012)
    false_pass, missed = simulate_passes(x, runs=1000, seed=1, naive=True)
    assert false_pass > 0.05 and missed > 0.05


def test_interval_narrows_monotonically_and_is_exact_at_the_end() -> None:
    x = population(500, flips_each_way=0.05, extra_drop=0.02)
    rng = np.random.default_rng(3)
    cs = WoRConfidenceSequence(x.size, 0.05)
    lower, upper = 0.0, 1.0
    for value in rng.permutation(x):
        cs.update(value)
        assert lower <= cs.lower[0] <= cs.upper[0] <= upper
        lower, upper = float(cs.lower[0]), float(cs.upper[0])
    assert lower == pytest.approx(x.mean(), abs=1e-9) and upper == pytest.approx(x.mean(), abs=1e-9)
    with pytest.raises(ValueError):
        cs.update(0.5)


def test_a_clean_artifact_passes_and_a_bad_one_fails_early() -> None:
    rng = np.random.default_rng(4)
    size = 14042
    for x, verdict in ((population(size, 0.02, 0.0), "pass"), (population(size, 0.05, 0.06), "fail")):
        gate = GateSequence(size, max_drop_points=GATE_POINTS, max_flip_rate=None)
        for value in rng.permutation(x):
            d = round(2 * value - 1)
            gate.add(reference_correct=d <= 0, candidate_correct=d >= 0, changed=d != 0)
            if gate.decided:
                break
        assert gate.decisions["drift"].verdict == verdict
        assert gate.decisions["drift"].questions < size


def test_decide() -> None:
    assert decide(-0.5, 0.9, 1.0) == "pass"
    assert decide(1.1, 3.0, 1.0) == "fail"
    assert decide(0.5, 1.5, 1.0) == "undecided"
