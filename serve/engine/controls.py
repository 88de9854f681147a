"""An engine as the surge controller drives it (`serve.engine.protocol.ControlledEngine`): its knobs set, its load
read, and whether a top-tier request waits on it. The controller and the fleet's worker hold this, never the
engine's internals; each call takes the engine's lock for as long as it reads or sets."""

from __future__ import annotations

import time
from collections.abc import Callable

from serve.engine.core import Engine
from serve.engine.protocol import Knobs, Load


class EngineControls:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def defer_to(self) -> Callable[[], bool] | None:
        return self.engine.defer_to

    @defer_to.setter
    def defer_to(self, until: Callable[[], bool] | None) -> None:
        self.engine.defer_to = until

    def configure(self, knobs: Knobs) -> None:
        """Set the scheduler's step limits (a controller's decision), from the next step on."""
        engine = self.engine
        with engine.wakeup:
            engine.scheduler.config = engine.scheduler.config.with_limits(knobs)
            engine.speculator.enabled = knobs.speculate and engine.speculator.policy.mode != "off"
            engine.wakeup.notify()

    def load(self) -> Load:
        """What a controller reads of the engine: per tier, the requests still waiting for their first token
        (queued, or seated but still prefilling: a batch of many seats hides a queue of prompts) and how long the
        oldest of them has waited; running requests; how many wait for a seat (saturation); and counts so far,
        which the controller takes differences of: requests finished, tokens computed, requests served and their
        tokens."""
        engine = self.engine
        now = time.monotonic()
        with engine.lock:
            waiting: dict[str, int] = {}
            oldest: dict[str, float] = {}
            for request in engine.awaiting_first_token():
                tier = request.owner.tier
                waiting[tier] = waiting.get(tier, 0) + 1
                oldest[tier] = max(oldest.get(tier, 0.0), now - request.arrival_time)
            stats = engine.stats
            return Load(
                waiting,
                len(engine.scheduler.running),
                stats.finished,
                oldest,
                stats.tokens,
                stats.served,
                stats.served_tokens,
                queued=engine.scheduler.num_waiting,
            )

    def top_tier_pending(self, waited: float = 0.0) -> bool:
        """Whether a request of the top tier (rank 0) has waited `waited` seconds or more for its first token."""
        since = time.monotonic() - waited
        with self.engine.lock:
            return any(
                r.owner.tier_rank == 0 and r.arrival_time <= since for r in self.engine.awaiting_first_token()
            )
