"""The surge controller: every tick, from what arrived and what is queued, the engine's knobs, how much of each tier
runs on which variant, and which tiers are refused for now.

Pure and tensor-free like `serve/core/scheduler.py`, with the time inside each `Observation`, so that a simulated
trace drives it deterministically (`tests/serve/test_control.py`); `serve.control.loop` feeds it from a server,
and the fleet gateway from Redis and its workers' heartbeats.

Each tick:
1. **Forecast** each tier's arrival rate over the next `horizon` seconds (`forecast.Holt`, chosen by measurement).
2. **Capacity**: the requests a second each variant (or the pool of variants sharing a machine) can finish: the
   tokens it computes a second while saturated (requests queued for a seat, or every seat taken; the last
   `capacity_window` seconds of such time) over the tokens a recent request cost; until measured it is `capacity`, the operator's
   figure (`qpack bench serve` measures it) when given, else unknown, and nothing is routed or shed on a guess.
3. **Mode**, with hysteresis: throughput (a larger batch, a larger prefill budget) as soon as the forecast load
   passes `rise` of capacity for two ticks while the arrivals counted over the last seconds confirm it (as
   many seconds as hold ten arrivals at that rate, at least 2: a burst of a few requests at a low rate makes a
   trend, not a surge), or a queue builds past half of a tier's first-token target (its predicted wait, as
   for shedding): so before the queue when the forecast sees the rise coming. Back to latency (a small batch
   and small prefill chunks, so tokens come fast) only once the arrivals of the last `calm_window` seconds
   average under `fall` of capacity and every tier's predicted wait has stayed under a quarter of its target
   for `dwell` seconds in a row. A relapse (throughput mode again within `relapse` seconds, or twice the dwell
   asked last) makes that dwell four times longer, up to `max_dwell`: where latency mode cannot carry the base
   load (bursts of it press on a target), the mode settles after a few tries instead of flipping every twenty
   seconds. In throughput mode the batch (seats, token budget and prefill chunk together) follows the
   measured TPOT and the top tier's TTFT: it shrinks while one nears its target and grows back when there is
   room; and a step never computes more tokens than an engine does, at its measured rate, in `step` of the top
   tier's first-token target.
4. **Routing** (several variants of one model): the top tier always runs on the most accurate variant. When the
   forecast load on it passes `rise` of its capacity, the excess moves to the cheaper variant, lowest tier first:
   a tier whole, then a share of the next (`shares`), each only if the variant's measured KL is within the
   tier's `max_kl`; the shares fall back to nothing in latency mode.
5. **Shedding**, only after routing (a tier that may run on the cheaper variant runs there whole for at least
   one tick before it is refused): a tier is shed (429, `Retry-After` the forecast time for its queue to
   drain) while the wait predicted for its next request (the queue of its own and higher tiers on the variants
   it runs on, over the capacity those leave) passes `margin` of its first-token target; it is admitted again
   under half of it. Refusals are monotone: when a tier is shed every lower tier is refused whole, and the top
   tier never is. So a higher tier is never refused while a lower one is admitted (nor does the scheduler ever
   preempt one for a lower one). The shed tier itself loses only the share of its requests the capacity its
   betters leave cannot take while its queue drains to `goal` of its target within the target (`shed_share`):
   all-or-nothing refusal of a tier whose arrivals are near what is left makes a limit cycle (refused, its
   queue drains, admitted, its queue rebuilds), with the shed level flapping every few seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from serve.control.forecast import Holt
from serve.control.slo import Slo
from serve.engine.protocol import Knobs, Load

LATENCY, THROUGHPUT = "latency", "throughput"
POOL = "pool"  # the capacity group of variants that share one machine


@dataclass(frozen=True)
class TierPolicy:
    name: str
    rank: int
    slo: Slo = field(default_factory=Slo)
    max_kl: float | None = None  # the largest measured KL of a variant it may be routed to (None: any)


@dataclass(frozen=True)
class Variant:
    """One artifact of the served model, and how far its answers are from the reference (its manifest's KL)."""

    name: str
    kl: float


@dataclass(frozen=True)
class Observation:
    now: float
    arrivals: dict[str, int]  # per tier since the last tick: every request that asked, refused ones included
    loads: dict[str, Load]  # per variant
    tpot_p95: dict[str, float] = field(default_factory=dict)  # per tier, recent
    ttft_p95: dict[str, float] = field(default_factory=dict)  # per tier, recent


@dataclass(frozen=True)
class Decision:
    mode: str
    knobs: Knobs
    forecast: float  # requests/s expected over the horizon, all tiers
    capacity: float | None  # requests/s the variants finish while busy, all together
    shed_from: int | None  # the tier of this rank is shed (`shed_share` of it), every lower one refused whole
    retry_after: float
    shares: dict[str, float]  # tier -> the share of its requests that runs on the cheaper variant
    accurate: str = ""  # the most accurate variant
    cheap: str | None = None  # the cheaper variant (None with one)
    changes: tuple[str, ...] = ()  # what this tick changed: mode, knobs, route, shed
    shed_share: float = 1.0  # the share of tier `shed_from`'s requests refused

    def refused(self, rank: int) -> float:
        """The share of a tier's requests refused now: all below the shed tier, `shed_share` of it, none above."""
        if self.shed_from is None or rank < self.shed_from:
            return 0.0
        return self.shed_share if rank == self.shed_from else 1.0

    def routes(self) -> dict[str, str]:
        """Tier -> the variant most of its requests run on."""
        return {
            t: self.cheap if self.cheap and share > 0.5 else self.accurate for t, share in self.shares.items()
        }


@dataclass(frozen=True)
class Backlog:
    """A tier's queue in one capacity group (see `Controller._backlogs`)."""

    ahead: float  # requests queued there that are served before its next one
    left: float  # requests/s the group has for it once the higher tiers' arrivals are served
    part: float  # the share of the tier's requests that runs there
    oldest: float  # seconds its oldest request there has waited


_LATENCY_KNOBS, _THROUGHPUT_KNOBS = Knobs(8, 256, 128), Knobs(32, 1024, 512)


@dataclass(frozen=True)
class ControlConfig:
    tick: float = 0.5
    horizon: float = 5.0
    latency: Knobs = _LATENCY_KNOBS
    throughput: Knobs = _THROUGHPUT_KNOBS
    rise: float = 0.8
    fall: float = 0.5
    dwell: float = 5.0
    calm_window: float = 20.0  # seconds of arrivals the way back to latency mode is judged by
    relapse: float = 30.0  # throughput mode again this soon after it ended: the dwell x4...
    max_dwell: float = 120.0  # ...up to this
    margin: float = 0.8
    goal: float = 0.25  # of a shed tier's first-token target: its queue's wait, less `probe` of it, when shed
    probe: float = 0.25  # a shed tier is admitted up to this much past the capacity left (see `Capacity`)
    shed: bool = True
    route: bool = True
    tpot_guard: bool = True
    capacity: float | None = None  # requests/s at full load, when the operator knows it (learned anyway)
    capacity_window: float = 20.0
    pooled: bool = True  # the variants share one machine's compute (one server): one capacity for them all
    persist: int = 2  # ticks the forecast must stay past `rise` before it alone switches the mode
    step: float = 0.25  # of the top tier's first-token target: the longest an engine step may take

    @classmethod
    def around(
        cls,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk: int | None,
        capacity: float | None = None,
    ) -> ControlConfig:
        """Modes around a server's configured limits: throughput mode is them (prefill chunks of a quarter of the
        budget unless set: a long prompt's chunk never stalls every running stream for long); latency mode a
        quarter of the batch, a quarter of the budget, chunks of an eighth."""
        budget = max_num_batched_tokens
        return cls(
            latency=Knobs(max(2, max_num_seqs // 4), max(128, budget // 4), max(64, budget // 8)),
            throughput=Knobs(max_num_seqs, budget, prefill_chunk or max(64, budget // 4)),
            capacity=capacity,
        )


@dataclass
class Capacity:
    """Requests a second a capacity group finishes at full load: the tokens it computes a second while busy (over
    the last `window` seconds of busy ticks) over the tokens a request costs (prompt and output, over the last
    `requests` served). Tokens, not completions: a batch that has just filled computes at full rate at once,
    while its first completions come a whole request's duration later. Until both are measured: the hint; after,
    never under it. Only saturated ticks count (`Controller._learn_capacity`): a base load keeps an engine busy
    with seated prompts at a fraction of its rate, and counting those taught a two-worker fleet 0.7 requests/s
    against a full-load 1.6 to 2.3 (the surge's standard tier was then refused nine times in ten). Once shedding
    admits what the estimate says fits, nothing shows it more, so the operator's figure (`--control-capacity`,
    which `qpack bench serve` measures at full load) is the floor, and a shed tier is admitted a `probe` past
    what the estimate leaves it: the queue that builds if the estimate was right is drained by the shed share's
    queue term, and if it was low the saturated ticks measure more."""

    window: float
    hint: float | None = None
    requests: int = 64
    ticks: list[tuple[float, int]] = field(default_factory=list)  # (busy seconds, tokens), newest last
    served: list[tuple[int, int]] = field(default_factory=list)  # (requests, their tokens), newest last

    def add(self, seconds: float, tokens: int) -> None:
        self.ticks.append((seconds, tokens))
        while sum(t for t, _ in self.ticks[1:]) >= self.window:
            self.ticks.pop(0)

    def cost(self, requests: int, tokens: int) -> None:
        if requests:
            self.served.append((requests, tokens))
            while sum(n for n, _ in self.served[1:]) >= self.requests:
                self.served.pop(0)

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens computed a second while busy (over the window), once two seconds of it are measured."""
        seconds = sum(t for t, _ in self.ticks)
        return sum(n for _, n in self.ticks) / seconds if seconds >= 2.0 else None

    @property
    def level(self) -> float | None:
        seconds = sum(t for t, _ in self.ticks)
        requests = sum(n for n, _ in self.served)
        if seconds >= 2.0 and requests >= 4:
            per_request = sum(t for _, t in self.served) / requests
            measured = sum(t for _, t in self.ticks) / seconds / max(1.0, per_request)
            return max(measured, self.hint or 0.0)
        return self.hint


class Controller:
    def __init__(self, config: ControlConfig, tiers: list[TierPolicy], variants: list[Variant]) -> None:
        if not variants:
            raise ValueError("the controller needs at least one variant")
        self.config = config
        self.tiers = sorted(tiers, key=lambda t: t.rank)
        self.variants = sorted(variants, key=lambda v: v.kl)
        self.forecasts: dict[str, Holt] = {t.name: Holt() for t in self.tiers}
        self.groups = (
            {POOL: [v.name for v in self.variants]}
            if config.pooled
            else {v.name: [v.name] for v in self.variants}
        )
        self.capacity = {group: Capacity(config.capacity_window) for group in self.groups}
        self.capacity[next(iter(self.groups))].hint = config.capacity
        self._rising = 0
        self._arrived: list[tuple[float, int]] = []
        self.mode, self.last = LATENCY, None  # type: str, float | None
        self.calm_since: float | None = None  # since when the load has been low enough for latency mode
        self.hold = config.dwell  # seconds of calm before latency mode: longer after each relapse
        self._left_at: float | None = None  # when throughput mode last ended
        self.scale = 1.0  # of the throughput knobs, steered by the measured TPOT
        self._tuned_at = -1e9
        self._busy: dict[str, bool] = {}
        self._stepping: dict[str, int] = {}  # per capacity group: its engines with work
        self.decision: Decision | None = None

    # ------------------------------------------------------------------ one tick

    def step(self, observation: Observation) -> Decision:
        now = observation.now
        elapsed = self.config.tick if self.last is None else max(1e-3, now - self.last)
        self.last = now
        for tier in self.tiers:
            self.forecasts[tier.name].update(observation.arrivals.get(tier.name, 0) / elapsed)
        steps = self.config.horizon / self.config.tick
        rates = {t.name: self.forecasts[t.name].forecast(steps) for t in self.tiers}
        self._learn_capacity(observation, elapsed)
        before = self.decision.shares if self.decision is not None else {t.name: 0.0 for t in self.tiers}
        mode = self._mode(sum(rates.values()), self._pressure(rates, before, observation), observation, now)
        shares = self._shares(rates, mode)
        shed_from, retry_after = self._shed(rates, shares, observation)
        shares, shed_from = self._route_before_shedding(shares, shed_from, mode)
        retry_after = retry_after if shed_from is not None else 0.0
        shed_share = self._shed_share(shed_from, rates, shares, observation)
        knobs = self._knobs(mode, observation, shed_from)
        cheap = self._cheap
        decision = Decision(
            mode,
            knobs,
            sum(rates.values()),
            self.total_capacity(),
            shed_from,
            retry_after,
            shares,
            self.variants[0].name,
            cheap.name if cheap is not None else None,
            shed_share=shed_share,
        )
        decision = dataclasses.replace(decision, changes=self._changes(decision))
        self.decision = decision
        return decision

    def _known(self) -> dict[str, float]:
        return {name: level for name, c in self.capacity.items() if (level := c.level) is not None}

    def total_capacity(self) -> float | None:
        known = self._known()
        return sum(known.values()) if known else None

    def _capacity_of(self, group: str) -> float | None:
        """A capacity group's capacity (the pool's, or a variant's); an unmeasured one is taken as the measured
        mean of the others."""
        known = self._known()
        if group in known:
            return known[group]
        return sum(known.values()) / len(known) if known else None

    def _group_of(self, variant: str) -> str:
        return POOL if self.config.pooled else variant

    def _learn_capacity(self, observation: Observation, elapsed: float) -> None:
        """A tick counts when it ran in throughput mode and the group (the pool, or a variant) was saturated at
        its start and at its end (requests queued for a seat, or every seat of a variant taken): it finished as
        fast as it can. Seated prompts still in prefill do not count: a base load keeps a few seated all the
        time, at a fraction of the rate a full batch computes."""
        seats = self.decision.knobs.max_num_seqs if self.decision is not None else 1
        for group, variants in self.groups.items():
            loads = [observation.loads.get(v, Load()) for v in variants]
            busy = any(load.queued > 0 or load.running >= seats for load in loads)
            if busy and self._busy.get(group) and self.mode == THROUGHPUT:
                self.capacity[group].add(elapsed, sum(load.tokens for load in loads))
            served = sum(load.served for load in loads)
            self.capacity[group].cost(served, sum(load.served_tokens for load in loads))
            self._busy[group] = busy
            self._stepping[group] = max(
                1, sum(load.engines for load in loads if load.running or sum(load.waiting.values()))
            )

    # ------------------------------------------------------------------ mode

    def _tightest_ttft(self) -> float | None:
        targets = [t.slo.ttft for t in self.tiers if t.slo.ttft is not None]
        return min(targets) if targets else None

    def _pressure(
        self, rates: dict[str, float], shares: dict[str, float], observation: Observation
    ) -> float | None:
        """How close the queue has come to breaking a promise: the largest predicted wait of a tier over its
        first-token target (None without targets or a capacity). Tiers are served in order, so a queue of free
        requests presses on the free tier's target only."""
        waits = self._waits(rates, shares, observation)
        ratios = [waits[t.rank] / t.slo.ttft for t in self.tiers if t.slo.ttft and t.rank in waits]
        return max(ratios, default=None)

    def _mode(self, forecast: float, pressure: float | None, observation: Observation, now: float) -> str:
        capacity = self.total_capacity()
        waiting = sum(sum(load.waiting.values()) for load in observation.loads.values())
        load = forecast / capacity if capacity else None
        building = waiting >= 2 and (
            (pressure is not None and pressure > 0.5)
            or (pressure is None and waiting > self.config.latency.max_num_seqs)
        )
        recent = self._recent_rate(observation, now)
        # as many seconds of arrivals as hold ten at the rise rate (at least 2): a Poisson count that small says
        # little, and at a request a second a few arrivals in a row are common
        window = max(2.0, 10.0 / (self.config.rise * capacity)) if capacity else 2.0
        confirmed = capacity is not None and self._rate_over(window, now) >= self.config.rise * capacity
        self._rising = self._rising + 1 if load is not None and load >= self.config.rise and confirmed else 0
        small = pressure is None or pressure < 0.25
        calm = small and (capacity is None or recent < self.config.fall * capacity)
        self.calm_since = (self.calm_since if self.calm_since is not None else now) if calm else None
        if self.mode == LATENCY and (self._rising >= self.config.persist or building):
            self.mode = THROUGHPUT
            relapsed = self._left_at is not None and now - self._left_at < max(
                self.config.relapse, 2 * self.hold
            )
            self.hold = min(self.config.max_dwell, 4 * self.hold) if relapsed else self.config.dwell
        elif self.mode == THROUGHPUT and calm and now - (self.calm_since or now) >= self.hold:
            self.mode = LATENCY
            self.scale = 1.0
            self._left_at = now
        return self.mode

    def _recent_rate(self, observation: Observation, now: float) -> float:
        """Arrivals a second over the last `calm_window` seconds: what the way back to latency mode is judged by
        (the forecast, a few arrivals a tick, is too noisy to stay under a threshold for long)."""
        self._arrived.append((now, sum(observation.arrivals.values())))
        while self._arrived and self._arrived[0][0] <= now - max(self.config.calm_window, 30.0):
            self._arrived.pop(0)
        return self._rate_over(self.config.calm_window, now)

    def _rate_over(self, seconds: float, now: float) -> float:
        """Arrivals a second counted over the last `seconds` (less at the start)."""
        counted = [n for at, n in self._arrived if at > now - seconds]
        first = next((at for at, _n in self._arrived if at > now - seconds), now)
        return sum(counted) / max(self.config.tick, min(seconds, now - first + self.config.tick))

    # ------------------------------------------------------------------ routing

    @property
    def _cheap(self) -> Variant | None:
        """The cheaper variant the lower tiers may move to (None with one variant)."""
        return self.variants[1] if len(self.variants) > 1 else None

    def _may_route(self, tier: TierPolicy, cheap: Variant) -> bool:
        """Whether `tier`'s quality budget allows the cheaper variant (the top tier never moves)."""
        return tier.rank > 0 and (tier.max_kl is None or cheap.kl <= tier.max_kl)

    @property
    def _shed_before(self) -> int | None:
        """The rank refused from at the last tick (None: nothing was)."""
        return self.decision.shed_from if self.decision is not None else None

    def _shares(self, rates: dict[str, float], mode: str) -> dict[str, float]:
        """Per tier, the share of its requests the cheaper variant takes: the forecast load past `rise` of the
        accurate variant's capacity, lowest tier first, within each tier's quality budget."""
        shares = {t.name: 0.0 for t in self.tiers}
        cheap = self._cheap
        capacity = self._capacity_of(self._group_of(self.variants[0].name))
        if cheap is None or not self.config.route or mode == LATENCY or not capacity:
            return shares
        excess = sum(rates.values()) - self.config.rise * capacity
        for tier in reversed(self.tiers):  # lowest first; never the top tier
            if excess <= 0 or tier.rank == 0:
                break
            if not self._may_route(tier, cheap):
                continue
            rate = rates[tier.name]
            moved = min(rate, excess)
            shares[tier.name] = moved / rate if rate > 0 else 1.0
            excess -= moved
        return shares

    def _route_before_shedding(
        self, shares: dict[str, float], shed_from: int | None, mode: str
    ) -> tuple[dict[str, float], int | None]:
        """A tier about to be refused that may run on the cheaper variant, and did not run on it whole last
        tick, moves there whole for this tick instead; it is refused from the next tick if its wait still
        calls for it. So routing always comes before shedding, even when a queue jumps past both thresholds
        within one tick (a slow machine, a long tick)."""
        previous, cheap = self._shed_before, self._cheap
        if shed_from is None or cheap is None or not self.config.route or mode == LATENCY:
            return shares, shed_from
        before = self.decision.shares if self.decision is not None else {}
        newly = [
            t
            for t in self.tiers
            if t.rank >= shed_from
            and (previous is None or t.rank < previous)
            and self._may_route(t, cheap)
            and before.get(t.name, 0.0) < 1.0 - 1e-9
        ]
        if not newly:
            return shares, shed_from
        return {**shares, **{t.name: 1.0 for t in newly}}, previous

    # ------------------------------------------------------------------ shedding

    def _backlogs(
        self, tier: TierPolicy, rates: dict[str, float], shares: dict[str, float], observation: Observation
    ) -> list[Backlog]:
        """The tier's queue in each capacity group it runs in: the requests ahead of its next one (queued of its
        own and higher tiers there), the capacity the higher tiers' forecast arrivals leave it (at least a
        quarter of it: a noisy forecast near capacity must not predict hours), the share of its requests that
        runs there, and how long its oldest request there has waited."""
        names = [v.name for v in self.variants]

        def part(of: TierPolicy, variant: str) -> float:
            cheap = shares[of.name]
            return (1.0 - cheap) if variant == names[0] else (cheap if variant == names[1] else 0.0)

        backlogs = []
        for group, variants in self.groups.items():
            capacity = self._capacity_of(group)
            mine = sum(part(tier, v) for v in variants)
            if not capacity or mine <= 0:
                continue
            ahead = sum(
                observation.loads.get(v, Load()).waiting.get(t.name, 0)
                for v in variants
                for t in self.tiers
                if t.rank <= tier.rank and part(t, v) > 0
            )
            higher = sum(
                rates[t.name] * part(t, v) for v in variants for t in self.tiers if t.rank < tier.rank
            )
            oldest = max(
                (observation.loads.get(v, Load()).oldest.get(tier.name, 0.0) for v in variants), default=0.0
            )
            backlogs.append(Backlog(ahead, max(0.25 * capacity, capacity - higher), mine, oldest))
        return backlogs

    def _waits(
        self, rates: dict[str, float], shares: dict[str, float], observation: Observation
    ) -> dict[int, float]:
        """Per tier rank, the seconds its next request is predicted to wait in the capacity groups it runs in
        (the longest): the requests ahead of it over the capacity left to it, and never less than its oldest
        request has already waited."""
        waits: dict[int, float] = {}
        for tier in self.tiers:
            backlogs = self._backlogs(tier, rates, shares, observation)
            if backlogs:
                waits[tier.rank] = max(max(b.ahead / b.left, b.oldest) for b in backlogs)
        return waits

    def _refused_share(
        self, tier: TierPolicy, rates: dict[str, float], shares: dict[str, float], observation: Observation
    ) -> float:
        """The share of the tier's forecast arrivals that cannot be admitted: in each group it runs in, the room
        is the capacity left to it less what drains the queue ahead of it down to `goal` of its first-token
        target within that target."""
        target, rate = self._ttft_target(tier), rates[tier.name]
        if rate <= 0:
            return 0.0
        admitted = 1.0
        for backlog in self._backlogs(tier, rates, shares, observation):
            excess = max(0.0, backlog.ahead - self.config.goal * target * backlog.left)
            room = max(0.0, (1.0 + self.config.probe) * backlog.left - excess / target)
            admitted = min(admitted, room / (rate * backlog.part))
        return min(1.0, max(0.0, 1.0 - admitted))

    @staticmethod
    def _ttft_target(tier: TierPolicy) -> float:
        assert tier.slo.ttft is not None
        return tier.slo.ttft

    def _shed(
        self, rates: dict[str, float], shares: dict[str, float], observation: Observation
    ) -> tuple[int | None, float]:
        """The highest tier to shed, and the Retry-After of its refusals: a tier whose predicted wait passes
        `margin` of its target; one shed last tick stays so while its wait is over half its target or its
        arrivals are more than the capacity left to it (else it would be admitted whole, its queue would
        rebuild, and it would be shed again a few ticks later)."""
        if not self.config.shed:
            return None, 0.0
        waits = self._waits(rates, shares, observation)
        shed_from: int | None = None
        for tier in self.tiers[1:]:
            target, wait = tier.slo.ttft, waits.get(tier.rank)
            if target is None or wait is None:
                continue
            if wait > self.config.margin * target:
                shed_from = tier.rank
                break
            already = self._shed_before is not None and tier.rank >= self._shed_before
            if already and (wait > 0.5 * target or self._refused_share(tier, rates, shares, observation) > 0):
                shed_from = tier.rank
                break
        if shed_from is None:
            return None, 0.0
        tier = next(t for t in self.tiers if t.rank == shed_from)
        drain = waits[shed_from] - self.config.goal * self._ttft_target(tier)
        return shed_from, min(60.0, max(1.0, drain))

    def _shed_share(
        self,
        shed_from: int | None,
        rates: dict[str, float],
        shares: dict[str, float],
        observation: Observation,
    ) -> float:
        if shed_from is None:
            return 1.0
        tier = next(t for t in self.tiers if t.rank == shed_from)
        return self._refused_share(tier, rates, shares, observation)

    # ------------------------------------------------------------------ knobs

    def _knobs(self, mode: str, observation: Observation, shed_from: int | None) -> Knobs:
        """The mode's preset; in throughput mode scaled (seats, token budget and prefill chunk together, never
        under the latency preset): down by a quarter while some served tier's TPOT p95, or the top tier's TTFT
        p95, is within 10% of its target; up by a tenth while all are under 60%; at most every 2 s (the p95
        needs that long to show it). In either mode the budget is then capped (`_capped`), and a top-tier prompt
        may take its step past it, up to the throughput preset's budget (`top_tier_tokens`): the cap keeps the
        step in flight short for a top-tier arrival, and its own prompt then goes in one step, not several
        (measured on two cores: a step costs 25 ms and each token about 4 ms, but a step with 40-110 prompt tokens
        0.6-1 s: every extra prompt step is time out of its target)."""
        latency, preset = self.config.latency, self.config.throughput
        top = preset.max_num_batched_tokens if len(self.tiers) > 1 and self.tiers[0].slo.ttft else 0
        if mode == LATENCY:
            return self._capped(latency, top)
        if self.config.tpot_guard and observation.now - self._tuned_at >= 2.0:
            self._tuned_at = observation.now
            self.scale = self._rescaled(observation, shed_from)

        def scaled(low: int, high: int) -> int:
            return max(low, round(high * self.scale))

        knobs = Knobs(
            scaled(latency.max_num_seqs, preset.max_num_seqs),
            scaled(latency.max_num_batched_tokens, preset.max_num_batched_tokens),
            scaled(latency.chunk, preset.chunk),
            preset.admission_wait,
            speculate=False,
        )
        return self._capped(knobs, top)

    def _rescaled(self, observation: Observation, shed_from: int | None) -> float:
        """The batch's scale for `_knobs`. The top tier's TTFT counts only while fewer of its prompts wait than
        there are seats: a step shorter by a smaller batch lets a waiting top-tier prompt start sooner, but with
        more of them waiting than seats their wait is the queue, which a smaller batch deepens (measured: a
        one-server surge scaled its int8 engine down to the 8-seat floor with 10-17 top-tier prompts queued, and
        a quarter of them met their target)."""
        served = [t for t in self.tiers if shed_from is None or t.rank < shed_from]
        ratios = [
            observation.tpot_p95[t.name] / t.slo.tpot
            for t in served
            if t.slo.tpot and t.name in observation.tpot_p95
        ]
        top = self.tiers[0]
        seats = self.decision.knobs.max_num_seqs if self.decision is not None else 1
        short_of_seats = sum(load.waiting.get(top.name, 0) for load in observation.loads.values()) >= seats
        if top.slo.ttft and top.name in observation.ttft_p95 and not short_of_seats:
            ratios.append(observation.ttft_p95[top.name] / top.slo.ttft)
        worst = max(ratios, default=None)
        if worst is not None and worst > 0.9:
            return max(0.0, self.scale * 0.75)
        if worst is None or worst < 0.6:
            return min(1.0, self.scale + 0.1)
        return self.scale

    def _capped(self, knobs: Knobs, top_tier_tokens: int) -> Knobs:
        """`knobs` with the step budget (and the prefill chunk within it) cut to `_step_tokens`, but never under
        the latency preset's budget. Measured on two cores (about 4 ms a token, decode or prompt): a floor of
        the seats' decodes and 32 prompt tokens kept every top-tier first token in time, but with 32 seats each
        step was three quarters decodes, prompts crawled in, and the standard tier met its target for 81% of
        its requests (90% with this floor, same sitting)."""
        cap = self._step_tokens()
        budget = knobs.max_num_batched_tokens
        if cap is not None:
            budget = min(budget, max(cap, self.config.latency.max_num_batched_tokens))
        return dataclasses.replace(
            knobs,
            max_num_batched_tokens=budget,
            prefill_chunk=min(budget, knobs.chunk),
            top_tier_tokens=max(top_tier_tokens, budget) if top_tier_tokens else 0,
        )

    def _step_tokens(self) -> int | None:
        """The most tokens one engine step may compute: what an engine of the slowest capacity group computes, at
        the group's measured rate shared by its engines with work, in `step` of the top tier's first-token
        target. A top-tier request jumps every queue but still waits for the step in flight and then its own,
        so on a slow machine a full throughput budget (a thousand prompt tokens a step can take seconds on two
        cores) would break its promise by itself. None until a rate is measured, or without a target."""
        target = self.tiers[0].slo.ttft
        rates = [
            rate / self._stepping.get(group, 1)
            for group, c in self.capacity.items()
            if (rate := c.tokens_per_second)
        ]
        if target is None or not rates:
            return None
        return round(min(rates) * self.config.step * target)

    def _changes(self, decision: Decision) -> tuple[str, ...]:
        before = self.decision
        if before is None:
            return ("mode",)
        changes = []
        if decision.mode != before.mode:
            changes.append("mode")
        if decision.knobs != before.knobs:
            changes.append("knobs")
        if decision.shares != before.shares:
            changes.append("route")
        if decision.shed_from != before.shed_from:
            changes.append("shed")
        return tuple(changes)
