"""Each tier's latency promise and whether it is kept: per request, then over a sliding window.

A tier's promise (`Slo`, from `ttft_ms` and `tpot_ms` in the tenants file) is per request: its first token
within `ttft` seconds of arrival and then a token every `tpot` seconds on average. A finished request met it or
not; a request refused to keep the others' promises (shed) did not get it at all. The `Ledger` keeps the last
`window` seconds of outcomes per tier, pure, with times passed in, and answers what the controller and
`/metrics` ask: attainment (the share of served requests that met the promise), goodput (requests a second that
met it), shed, and the p95 of TTFT and TPOT.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from serve.tenancy.tenants import Tier


@dataclass(frozen=True)
class Slo:
    ttft: float | None = None  # seconds to the first token
    tpot: float | None = None  # seconds per output token after the first

    @classmethod
    def of(cls, tier: Tier) -> Slo:
        return cls(
            None if tier.ttft_ms is None else tier.ttft_ms / 1000,
            None if tier.tpot_ms is None else tier.tpot_ms / 1000,
        )

    def met(self, ttft: float | None, tpot: float | None) -> bool:
        """Kept for one request: a first token in time (required when promised), and its later tokens in time
        (when it had any)."""
        first = self.ttft is None or (ttft is not None and ttft <= self.ttft)
        rest = self.tpot is None or tpot is None or tpot <= self.tpot
        return first and rest


@dataclass(frozen=True)
class Outcome:
    at: float
    served: bool  # False: shed
    met: bool = False
    ttft: float | None = None
    tpot: float | None = None


@dataclass(frozen=True)
class OffloadStats:
    served: int
    met: int
    shed: int
    attainment: float | None  # met / served; None with nothing served
    goodput: float  # requests/s that met the promise
    ttft_p95: float | None
    tpot_p95: float | None


def p95(values: list[float]) -> float | None:
    """The nearest-rank 95th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Ledger:
    """The outcomes of the last `window` seconds, per tier."""

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._outcomes: dict[str, deque[Outcome]] = {}

    def finished(self, tier: str, now: float, ttft: float | None, tpot: float | None, met: bool) -> None:
        self._outcomes.setdefault(tier, deque()).append(Outcome(now, True, met, ttft, tpot))

    def shed(self, tier: str, now: float) -> None:
        self._outcomes.setdefault(tier, deque()).append(Outcome(now, False))

    def stats(self, tier: str, now: float) -> OffloadStats:
        found = self._outcomes.get(tier, deque())
        while found and found[0].at < now - self.window:
            found.popleft()
        served = [o for o in found if o.served]
        met = sum(o.met for o in served)
        return OffloadStats(
            served=len(served),
            met=met,
            shed=len(found) - len(served),
            attainment=met / len(served) if served else None,
            goodput=met / self.window,
            ttft_p95=p95([o.ttft for o in served if o.ttft is not None]),
            tpot_p95=p95([o.tpot for o in served if o.tpot is not None]),
        )

    def tiers(self) -> list[str]:
        return list(self._outcomes)
