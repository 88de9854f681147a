"""Sequential gates: stop scoring MMLU as soon as a CI gate is decided, with the error rate still controlled.

A gate such as `--max-drift 1.0` on a fixed sample of a few hundred questions cannot tell a 1-point regression
from noise, and the full 14,042 questions cost hours. Questions are therefore scored in a seeded uniformly
random order and, after each question, an anytime-valid confidence sequence (CS) for the full test set's value
is updated; the gate is decided the first time the CS lies entirely on one side of the threshold. Because a CS
holds at every sample size simultaneously (with probability >= 1 - alpha it never excludes the true value),
looking after every question is allowed, unlike recomputing a fixed-sample CI and stopping when it happens to
clear the gate, which inflates the false-pass rate well beyond alpha.

The CS is the predictable plug-in empirical-Bernstein one of Waudby-Smith & Ramdas ("Estimating means of
bounded random variables by betting", JRSS-B 2024), in its form for sampling *without* replacement from a
finite population: the test set is the population, so the interval shrinks to the exact value as the sample
approaches it. Empirical Bernstein adapts to the variance, which matters here: an int8 artifact changes few
answers, so the per-question differences are mostly 0 and the CS is far narrower than Hoeffding's.

Why uniform and not subject-stratified order: the without-replacement martingale needs every remaining
question to be equally likely next. A stratified order would break that, and with it the error guarantee; a
uniform order of 14,042 questions covers every subject close to proportionally anyway, and the scorer still
batches each chunk by subject to reuse the few-shot prefix.

Values must lie in [0, 1]: a per-question accuracy difference d in {-1, 0, 1} enters as (d + 1) / 2 and a flip
as 0/1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def _psi(lam: np.ndarray) -> np.ndarray:
    return (-np.log1p(-lam) - lam) / 4


@dataclass
class WoRConfidenceSequence:
    """Two-sided (1 - alpha) CS for the mean of `population` values in [0, 1] drawn without replacement.

    Vectorized over independent runs (`runs`), so thousands of simulated runs cost one loop over time.
    Invariants: 0 <= lower <= upper <= 1; lower never decreases and upper never increases (the running
    intersection, valid because the CS holds at all times at once); after all `population` values the interval
    is the exact mean."""

    population: int
    alpha: float = 0.05
    runs: int = 1
    max_bet: float = 0.5
    t: int = 0
    _sum: np.ndarray = field(init=False)
    _mean_hat: np.ndarray = field(init=False)
    _sq: np.ndarray = field(init=False)
    _a: np.ndarray = field(init=False)  # per side: sum of lambda_i * (x_i + S_{i-1} / (N - i + 1))
    _b: np.ndarray = field(init=False)  # sum of lambda_i * N / (N - i + 1)
    _v: np.ndarray = field(init=False)  # per side: sum of v_i * psi(lambda_i)
    lower: np.ndarray = field(init=False)
    upper: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.population < 1 or not 0 < self.alpha < 1:
            raise ValueError("population must be >= 1 and alpha in (0, 1)")
        shape = (2, self.runs)
        self._sum = np.zeros(shape)
        self._mean_hat = np.full(shape, 0.5)
        self._sq = np.full(self.runs, 0.25)
        self._a = np.zeros(shape)
        self._b = np.zeros(self.runs)
        self._v = np.zeros(shape)
        self.lower = np.zeros(self.runs)
        self.upper = np.ones(self.runs)

    def update(self, x: np.ndarray | float) -> None:
        """Add the next value of every run (x: [runs] in [0, 1])."""
        if self.t >= self.population:
            raise ValueError("all values of the population were already added")
        values = np.broadcast_to(np.asarray(x, dtype=np.float64), (self.runs,))
        sides = np.stack([values, 1.0 - values])  # [2, runs]: x for the lower bound, 1 - x for the upper
        self.t += 1
        i, n = self.t, self.population
        variance = self._sq / i
        lam = np.minimum(np.sqrt(2 * math.log(2 / self.alpha) / (variance * i * math.log1p(i))), self.max_bet)
        remaining = n - i + 1
        self._a += lam * (sides + self._sum / remaining)
        self._b += lam * n / remaining
        self._v += 4 * (sides - self._mean_hat) ** 2 * _psi(lam)
        self._sum += sides
        self._mean_hat = (0.5 + self._sum) / (i + 1)
        self._sq += (values - self._mean_hat[0]) ** 2
        bounds = (self._a - self._v - math.log(2 / self.alpha)) / self._b  # lower bounds of mu and of 1 - mu
        self.lower = np.clip(np.maximum(self.lower, bounds[0]), 0.0, 1.0)
        self.upper = np.clip(np.minimum(self.upper, 1.0 - bounds[1]), 0.0, 1.0)
        if i == n:
            self.lower = self._sum[0] / n  # the whole population seen: its mean is known, not estimated
            self.upper = self.lower.copy()


@dataclass(frozen=True)
class Decision:
    """A gate's verdict: 'pass', 'fail', or 'undecided', the CS it rests on, the sample size it took and the
    threshold it was decided against."""

    verdict: str
    lower: float
    upper: float
    questions: int
    threshold: float


def decide(lower: float, upper: float, threshold: float) -> str:
    """A quantity gated as `value <= threshold`: pass when the whole CS is at or below it, fail when above."""
    if upper <= threshold:
        return "pass"
    if lower > threshold:
        return "fail"
    return "undecided"


@dataclass
class GateSequence:
    """Drift and flip-rate gates followed question by question (one run)."""

    population: int
    max_drop_points: float | None
    max_flip_rate: float | None
    alpha: float = 0.05
    drift: WoRConfidenceSequence = field(init=False)
    flips: WoRConfidenceSequence = field(init=False)
    decisions: dict[str, Decision] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.drift = WoRConfidenceSequence(self.population, self.alpha)
        self.flips = WoRConfidenceSequence(self.population, self.alpha)

    @property
    def gates(self) -> list[str]:
        return [
            name
            for name, value in (("drift", self.max_drop_points), ("flips", self.max_flip_rate))
            if value is not None
        ]

    def drop_interval(self) -> tuple[float, float]:
        """The CS of the accuracy drop, in points (reference minus artifact)."""
        return (
            100 * (1 - 2 * float(self.drift.upper[0])),
            100 * (1 - 2 * float(self.drift.lower[0])),
        )

    def flip_interval(self) -> tuple[float, float]:
        return float(self.flips.lower[0]), float(self.flips.upper[0])

    def add(self, reference_correct: bool, candidate_correct: bool, changed: bool) -> None:
        self.drift.update((int(candidate_correct) - int(reference_correct) + 1) / 2)
        self.flips.update(float(changed))
        if self.max_drop_points is not None and "drift" not in self.decisions:
            low, high = self.drop_interval()
            verdict = decide(low, high, self.max_drop_points)
            if verdict != "undecided":
                self.decisions["drift"] = Decision(verdict, low, high, self.drift.t, self.max_drop_points)
        if self.max_flip_rate is not None and "flips" not in self.decisions:
            low, high = self.flip_interval()
            verdict = decide(low, high, self.max_flip_rate)
            if verdict != "undecided":
                self.decisions["flips"] = Decision(verdict, low, high, self.flips.t, self.max_flip_rate)

    @property
    def decided(self) -> bool:
        return all(name in self.decisions for name in self.gates)
