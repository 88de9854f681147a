"""The surge controller at a fleet gateway: the same `ControlLoop` and `Controller` as a single server, one per
model, fed from what the gateway sees of the whole fleet.

Each tick the gateway reads its live workers (their heartbeats carry each engine's queue per tier, running and
finished requests, and the variant it serves with that variant's measured KL) and adds what it has queued in Redis
that no worker has accepted yet. The decision's routes and refusals apply at this gateway's door; its knobs go
to `control:{model}` in Redis, where every worker of the model picks them up with its next heartbeat (about a
second later). Variants are the variants the workers announce: when a variant's first worker joins (or its last
one leaves) the model's loop is rebuilt, its forecasts and capacity learned again.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from serve.control.controller import ControlConfig, Controller, Decision, Variant
from serve.control.loop import ControlLoop, policies
from serve.engine.protocol import Load
from serve.fleet import wire as P
from serve.metrics import ControlMetrics
from serve.tenancy.tenants import TenantsSource
from serve.variants import top_tier_patience


@dataclass
class _Model:
    loop: ControlLoop
    variants: tuple[tuple[str, float], ...]
    pooled: bool  # every worker process holds every variant: one capacity for them all
    loads: dict[str, Load] = field(default_factory=dict)
    published: Decision | None = None


class FleetControl:
    def __init__(
        self, redis: Any, config: ControlConfig | None, tenants: TenantsSource, metrics: ControlMetrics
    ) -> None:
        self.redis, self.config, self.tenants, self.metrics = redis, config, tenants, metrics
        self.models: dict[str, _Model] = {}
        self.unaccepted: dict[str, dict[str, int]] = {}  # variant -> tier -> queued here, not yet taken

    def loop_for(self, model: str, workers: list[P.WorkerInfo]) -> ControlLoop:
        """The model's loop over the variants its live workers serve (most accurate first)."""
        mine = [w for w in workers if w.model == model]
        variants = tuple(sorted({(w.variant_name, w.kl) for w in mine}, key=lambda b: b[1]))
        pooled = cohosted(mine)
        known = self.models.get(model)
        if known is not None and ((known.variants, known.pooled) == (variants, pooled) or not variants):
            return known.loop
        tiers = self.tenants.current.tiers
        controller = None
        if self.config is not None:
            grouped = dataclasses.replace(self.config, pooled=pooled)
            controller = Controller(grouped, policies(tiers), [Variant(name, kl) for name, kl in variants])
        state = _Model(
            ControlLoop(
                tiers,
                [name for name, _kl in variants],
                lambda: {},
                lambda _d: None,
                self.metrics.for_(model) if self.metrics.per else self.metrics,
                controller,
            ),
            variants,
            pooled,
        )
        state.loop.loads = lambda: state.loads
        self.models[model] = state
        return state.loop

    def queued(self, variant: str, tier: str, delta: int) -> None:
        tiers = self.unaccepted.setdefault(variant, {})
        tiers[tier] = max(0, tiers.get(tier, 0) + delta)

    async def tick(self, workers: list[P.WorkerInfo]) -> None:
        """One tick of every model's loop; knobs that changed are published for its workers."""
        for model in list(self.models):
            loop = self.loop_for(model, workers)
            state = self.models[model]
            state.loads = self._loads(model, workers)
            decision = loop.tick()
            if decision is not None and decision.knobs != (
                state.published.knobs if state.published else None
            ):
                await self._publish(model, decision)
                state.published = decision

    def _loads(self, model: str, workers: list[P.WorkerInfo]) -> dict[str, Load]:
        """Per variant, its workers' loads summed, with what this gateway queued that none of them took yet."""
        loads: dict[str, Load] = {}
        for worker in workers:
            if worker.model != model:
                continue
            unaccepted = dict(self.unaccepted.get(worker.variant_name, {}))
            load = loads.get(worker.variant_name) or Load(
                unaccepted, engines=0, queued=sum(unaccepted.values())
            )
            waiting, oldest = dict(load.waiting), dict(load.oldest)
            for tier, count in worker.waiting.items():
                waiting[tier] = waiting.get(tier, 0) + count
            for tier, seconds in worker.oldest.items():
                oldest[tier] = max(oldest.get(tier, 0.0), seconds)
            loads[worker.variant_name] = Load(
                waiting,
                load.running + worker.running,
                load.finished + worker.finished,
                oldest,
                load.tokens + worker.tokens,
                load.served + worker.served,
                load.served_tokens + worker.served_tokens,
                load.engines + 1,
                load.queued + worker.queued,
            )
        return loads

    async def _publish(self, model: str, decision: Decision) -> None:
        knobs = decision.knobs
        fields = {
            **P.knobs_fields(knobs),
            "patience": self._patience(),
            "mode": decision.mode,
            "version": f"{time.time():.3f}-{uuid.uuid4().hex[:6]}",
        }
        await self.redis.hset(P.control_key(model), mapping=fields)

    def _patience(self) -> float:
        """How long a top-tier prompt waits on a worker process before the cheaper variants there give way to it: a
        quarter of the top tier's first-token target (`serve.variants.prioritize`)."""
        return top_tier_patience(self.tenants.current.tiers)


def cohosted(workers: list[P.WorkerInfo]) -> bool:
    """Whether the workers' processes each hold every variant (so all variants share each process's cores: one
    capacity for the fleet), rather than a variant each (a capacity per variant)."""
    variants = {w.variant_name for w in workers}
    hosts: dict[str, set[str]] = {}
    for worker in workers:
        hosts.setdefault(worker.host or worker.worker_id, set()).add(worker.variant_name)
    return len(variants) > 1 and all(held == variants for held in hosts.values())
