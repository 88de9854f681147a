"""What the engine counts: its own stats (peaks, steps, requests served) and its Prometheus metrics (gauges of
the batch and the pool, latencies, per-tenant and per-tier tokens and queue time).

Kept apart from the step so that the step reads as schedule, run, commit; every call here happens under the
engine lock, from the step or from a request's arrival or end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from serve.core.request import Request
from serve.core.scheduler import Scheduler, SchedulerOutput
from serve.metrics import Metrics


@dataclass
class EngineStats:
    peak_kv_waste: float = 0.0
    peak_kv_allocated: int = 0
    peak_running: int = 0
    steps: int = 0
    finished: int = 0  # requests finished so far, however they ended
    tokens: int = 0  # tokens computed so far (prompt chunks and decodes)
    served: int = 0  # finished requests that ran (were seated)
    served_tokens: int = 0  # their prompt and output tokens
    extra: dict[str, Any] = field(default_factory=dict)


class Accounting:
    def __init__(self, metrics: Metrics, scheduler: Scheduler) -> None:
        self.metrics = metrics
        self.scheduler = scheduler
        self.stats = EngineStats()
        metrics.kv_blocks_total.set(scheduler.pool.num_blocks)

    def arrived(self, request: Request) -> None:
        owner = request.owner
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        self.metrics.tenants.tokens.labels(owner.tenant, owner.tier, "prompt").inc(len(request.prompt_ids))

    def stepped(self, scheduled: SchedulerOutput) -> None:
        self.stats.steps += 1
        self.stats.tokens += scheduled.num_tokens
        self.metrics.steps.inc()

    def admitted(self, scheduled: SchedulerOutput) -> None:
        """Preemptions, and queue time, per tenant and tier, of the requests that got their first seat this step."""
        if scheduled.preempted:
            self.metrics.preemptions.inc(len(scheduled.preempted))
        now = time.monotonic()
        for item in scheduled.scheduled:
            request = item.request
            if request.admitted_time is None:
                request.admitted_time = now
                owner = request.owner
                self.metrics.tenants.queue.labels(owner.tenant, owner.tier).observe(
                    now - request.arrival_time
                )

    def token(self, request: Request, now: float, emitted: bool) -> None:
        """A token sampled for `request` at `now` (`emitted`: it joined the output rather than ending it)."""
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft.observe(now - request.arrival_time)
            self.metrics.cached_prompt_tokens.inc(request.cached_prompt_tokens)
        request.last_token_time = now
        if emitted:
            self.metrics.generated_tokens.inc()

    def completed(self, request: Request, now: float) -> None:
        """Latencies of a request that ran to its end (stop or length)."""
        self.metrics.e2e.observe(now - request.arrival_time)
        if len(request.output_ids) > 1 and request.first_token_time is not None:
            self.metrics.tpot.observe((now - request.first_token_time) / (len(request.output_ids) - 1))

    def finished(self, request: Request, reason: str) -> None:
        """A request finished, however it ended."""
        self.stats.finished += 1
        if request.admitted_time is not None:
            self.stats.served += 1
            self.stats.served_tokens += len(request.prompt_ids) + len(request.output_ids)
        owner = request.owner
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.tenants.tokens.labels(owner.tenant, owner.tier, "completion").inc(
            len(request.output_ids)
        )

    def failed(self, scope: str, count: int = 1) -> None:
        self.metrics.request_errors.labels(scope=scope).inc(count)

    def gauges(self) -> None:
        scheduler = self.scheduler
        allocated, unused = scheduler.kv.waste(scheduler.running)
        ratio = unused / allocated if allocated else 0.0
        if allocated > self.stats.peak_kv_allocated:
            self.stats.peak_kv_allocated = allocated
            self.stats.peak_kv_waste = ratio
        self.metrics.kv_waste.set(ratio)
        self.metrics.queue_depth.set(scheduler.num_waiting)
        self.metrics.running.set(len(scheduler.running))
        self.metrics.kv_blocks_used.set(scheduler.pool.num_used)
        self.metrics.prefix_hit_rate.set(scheduler.pool.hit_rate)
        self.stats.peak_running = max(self.stats.peak_running, len(scheduler.running))
