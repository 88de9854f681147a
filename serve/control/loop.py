"""The controller in a running server: counts what arrives, keeps the tiers' promises on the ledger, and every tick
hands the pure `Controller` an `Observation` of the engines (one per variant) and applies its `Decision`: the
engines' knobs, which variant each tier runs on, which tiers the door refuses for now.

The door (the HTTP routes, or a fleet gateway's) calls `arrived` for every request its tenant's limits let in (a
tenant's own 429s are not its tier's demand: counting them would let one tenant get its tier's peers shed), then
`refusal` (a 429 while its tier is shed, `Retry-After` the forecast drain time), `variant_for` (its tier's route,
or the variant it pinned), and when the request ends `finished` with its measured TTFT and TPOT (or `shed`).
Without a controller (a static configuration) the loop still keeps the ledger and its metrics, so the static
baselines are measured by the same code.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve.control.controller import LATENCY, THROUGHPUT, Controller, Decision, Observation, TierPolicy
from serve.control.slo import Ledger, Slo
from serve.engine.protocol import Load
from serve.metrics import ControlMetrics
from serve.refusal import Refusal
from serve.tenancy.tenants import Caller, Tier

LoadSource = Callable[
    [], dict[str, Load]
]  # per variant: waiting per tier, running, finished so far (cumulative)
Apply = Callable[[Decision], None]  # sets the decision's knobs where the engines are


def policies(tiers: tuple[Tier, ...]) -> list[TierPolicy]:
    return [TierPolicy(t.name, t.rank, Slo.of(t), t.max_kl) for t in tiers]


@dataclass(frozen=True)
class Route:
    variant: str
    pinned: bool = False


class ControlLoop:
    def __init__(
        self,
        tiers: tuple[Tier, ...],
        variants: list[str],
        loads: LoadSource,
        apply: Apply,
        metrics: ControlMetrics,
        controller: Controller | None = None,
        clock: Callable[[], float] = time.monotonic,
        window: float = 30.0,
    ) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.variants = variants  # the most accurate first
        self.loads, self.apply, self.metrics, self.controller, self.clock = (
            loads,
            apply,
            metrics,
            controller,
            clock,
        )
        self.ledger = Ledger(window)
        self.recent = Ledger(10.0)  # the TTFT and TPOT the controller steers by: the last 10 s
        self.decision: Decision | None = None
        self._arrivals: dict[str, int] = {}
        self._totals: dict[str, tuple[int, int, int, int]] = {}  # per variant: its counts at the last tick
        self._credit: dict[str, float] = {}  # per tier: its share of the cheaper variant, accumulated
        self._refusal_credit: dict[str, float] = {}  # per tier: its refused share, accumulated
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the door (any thread)

    def arrived(self, caller: Caller) -> None:
        with self._lock:
            self._arrivals[caller.tier] = self._arrivals.get(caller.tier, 0) + 1
        self.metrics.arrivals.labels(caller.tier).inc()

    def refusal(self, caller: Caller) -> Refusal | None:
        """The refusal (overloaded; HTTP: a 429) of a request whose tier is shed now (counted), else None. Of the shed tier only its share is
        refused, spread evenly as `variant_for` spreads a route's share (a running credit per tier)."""
        decision = self.decision
        if decision is None:
            return None
        share = decision.refused(caller.tier_rank)
        if share <= 0.0 or not self._spend(self._refusal_credit, caller.tier, share):
            return None
        self.shed(caller)
        retry = max(1, round(decision.retry_after))
        return Refusal(
            "overloaded",
            f"the server is over capacity for tier {caller.tier!r}; higher tiers are served first: retry in {retry} s",
            code="overloaded",
            kind="rate_limit_error",
            retry_after=retry,
        )

    def variant_for(self, caller: Caller, pinned: str | None = None) -> Route:
        """The variant that answers: the one the request named, else the most accurate one, or the cheaper one
        for the share of its tier the controller moved there (spread evenly: each tier's requests carry a
        running credit of that share, and go to the cheaper variant whenever it reaches one)."""
        decision = self.decision
        if pinned is not None:
            route = Route(pinned, True)
        elif decision is None or decision.cheap is None:
            route = Route(self.variants[0])
        else:
            moved = self._spend(self._credit, caller.tier, decision.shares.get(caller.tier, 0.0))
            route = Route(decision.cheap if moved else decision.accurate)
        self.metrics.variant_requests.labels(route.variant, caller.tier).inc()
        return route

    def _spend(self, credits: dict[str, float], tier: str, share: float) -> bool:
        """Whether this request of `tier` is one of the `share` singled out: the tier's credit grows by the share
        with each request and is spent whenever it reaches one, so a share of 0.3 picks 3 requests in 10,
        evenly, and a share of 1 every one."""
        with self._lock:
            credit = credits.get(tier, 0.0) + share
            picked = credit >= 1.0 - 1e-9
            credits[tier] = credit - 1.0 if picked else credit
        return picked

    def finished(self, caller: Caller, ttft: float | None, tpot: float | None) -> None:
        tier = self.tiers.get(caller.tier)
        met = Slo.of(tier).met(ttft, tpot) if tier is not None else True
        now = self.clock()
        with self._lock:
            self.ledger.finished(caller.tier, now, ttft, tpot, met)
            self.recent.finished(caller.tier, now, ttft, tpot, met)
        self.metrics.outcomes.labels(caller.tier, "met" if met else "missed").inc()

    def shed(self, caller: Caller) -> None:
        with self._lock:
            self.ledger.shed(caller.tier, self.clock())
        self.metrics.outcomes.labels(caller.tier, "shed").inc()

    # ------------------------------------------------------------------ the tick (the loop's thread)

    def tick(self) -> Decision | None:
        now = self.clock()
        with self._lock:
            arrivals, self._arrivals = self._arrivals, {}
            recent = {t: self.recent.stats(t, now) for t in self.tiers}
            tpot = {t: s.tpot_p95 for t, s in recent.items() if s.tpot_p95 is not None}
            ttft = {t: s.ttft_p95 for t, s in recent.items() if s.ttft_p95 is not None}
            stats = {t: self.ledger.stats(t, now) for t in self.tiers}
        for name, tier_stats in stats.items():
            if tier_stats.attainment is not None:
                self.metrics.attainment.labels(name).set(tier_stats.attainment)
            self.metrics.goodput.labels(name).set(tier_stats.goodput)
        if self.controller is None:
            return None
        loads = {}
        for variant, load in self.loads().items():
            before = self._totals.get(variant, (0, 0, 0, 0))
            totals = (load.finished, load.tokens, load.served, load.served_tokens)
            grown = [max(0, a - b) for a, b in zip(totals, before, strict=True)]  # a worker gone: never < 0
            finished, tokens, served, served_tokens = grown
            loads[variant] = dataclasses.replace(
                load, finished=finished, tokens=tokens, served=served, served_tokens=served_tokens
            )
            self._totals[variant] = totals
        decision = self.controller.step(Observation(now, arrivals, loads, tpot, ttft))
        if decision.changes:
            self.apply(decision)
        self.decision = decision
        self._report(decision)
        return decision

    def _report(self, decision: Decision) -> None:
        metrics = self.metrics
        for mode in (LATENCY, THROUGHPUT):
            metrics.mode.labels(mode).set(1.0 if decision.mode == mode else 0.0)
        metrics.forecast.set(decision.forecast)
        metrics.capacity.set(decision.capacity or 0.0)
        metrics.shed_from.set(-1 if decision.shed_from is None else decision.shed_from)
        metrics.shed_share.set(0.0 if decision.shed_from is None else decision.shed_share)
        knobs = decision.knobs
        for knob, value in (
            ("max_num_seqs", knobs.max_num_seqs),
            ("max_num_batched_tokens", knobs.max_num_batched_tokens),
            ("prefill_chunk", knobs.prefill_chunk),
            ("admission_wait", knobs.admission_wait),
            ("top_tier_tokens", knobs.top_tier_tokens),
        ):
            metrics.knobs.labels(knob).set(value)
        for kind in decision.changes:
            metrics.decisions.labels(kind).inc()

    def run(self, stop: threading.Event, interval: float | None = None) -> None:
        """Tick every `interval` seconds (the controller's own tick unless given) until `stop` is set."""
        if interval is None:
            interval = self.controller.config.tick if self.controller is not None else 0.5
        while not stop.wait(interval):
            self.tick()
