"""Prometheus metrics of the serving engine, in a registry of its own (several engines can live in one process)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class TenantUsage:
    """What each tenant used, per tier (`prefix`: qpack for an engine, qpack_fleet for a gateway): tokens, and the
    time its requests waited (`queue_help` says from when to when). Labels are names from the tenants file."""

    def __init__(self, r: CollectorRegistry, prefix: str, queue_help: str) -> None:
        per = ["tenant", "tier"]
        self.tokens = Counter(
            f"{prefix}_tenant_tokens", "Tokens per tenant and tier", [*per, "kind"], registry=r
        )
        self.queue = Histogram(
            f"{prefix}_tenant_queue_seconds",
            f"{queue_help}, per tenant and tier",
            per,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )


class SpeculationMetrics:
    """Speculative decoding (serve/speculative): proposals per source, what was kept, what a verifying step yields."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.proposed = Counter(
            "qpack_spec_proposed_tokens", "Speculative tokens proposed, per source", ["source"], registry=r
        )
        self.accepted = Counter(
            "qpack_spec_accepted_tokens",
            "Speculative tokens the target accepted, per source",
            ["source"],
            registry=r,
        )
        self.steps = Counter(
            "qpack_spec_verify_steps",
            "Requests' verifying steps (one target step checking proposals)",
            registry=r,
        )
        self.emitted = Counter(
            "qpack_spec_emitted_tokens",
            "Tokens emitted by verifying steps (accepted proposals + one)",
            registry=r,
        )
        self.acceptance = Gauge(
            "qpack_spec_acceptance_rate", "Accepted / proposed speculative tokens so far", registry=r
        )
        self.tokens_per_step = Gauge(
            "qpack_spec_tokens_per_target_step", "Tokens emitted per verifying step so far", registry=r
        )


class TenantMetrics:
    """A front door's answers per tenant and tier (a server's, or a fleet gateway's with `prefix` qpack_fleet):
    requests by HTTP status, refusals by the limit that refused, and reloads of the tenants file. Never key
    material: tenant and tier names only."""

    def __init__(self, r: CollectorRegistry, prefix: str) -> None:
        per = ["tenant", "tier"]
        self.requests = Counter(
            f"{prefix}_tenant_requests",
            "Requests answered, per tenant, tier and HTTP status",
            [*per, "status"],
            registry=r,
        )
        self.rate_limited = Counter(
            f"{prefix}_tenant_rate_limited",
            "Requests refused by a tenant's limit (429), per limit: requests, tokens, concurrency",
            [*per, "limit"],
            registry=r,
        )
        self.reloads = Counter(
            f"{prefix}_tenants_reloads", "Tenants file reloads (SIGHUP) by outcome", ["outcome"], registry=r
        )

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("ok" if ok else "failed").inc()


class Scoped:
    """A metric seen through its leading labels already set (a gateway's `model`): `.labels(...)` takes the rest,
    `.set`/`.inc` act on the scope's own series."""

    def __init__(self, metric: Gauge | Counter, scope: tuple[str, ...]) -> None:
        self.metric, self.scope = metric, scope

    def labels(self, *values: str) -> Any:
        return self.metric.labels(*self.scope, *values)

    def set(self, value: float) -> None:
        (self.metric.labels(*self.scope) if self.scope else self.metric).set(value)  # type: ignore[union-attr]


_CONTROL_FAMILIES: tuple[tuple[str, type[Gauge] | type[Counter], str, str, tuple[str, ...]], ...] = (
    (
        "attainment",
        Gauge,
        "slo_attainment",
        "Share of served requests that met their tier's SLO (window)",
        ("tier",),
    ),
    ("goodput", Gauge, "goodput", "Requests per second that met their tier's SLO (window)", ("tier",)),
    (
        "outcomes",
        Counter,
        "slo_requests",
        "Requests by tier and outcome: met, missed, shed",
        ("tier", "outcome"),
    ),
    (
        "arrivals",
        Counter,
        "control_arrivals",
        "Requests the controller counted as arrivals, by tier (those the tenant's own limits let in)",
        ("tier",),
    ),
    ("mode", Gauge, "control_mode", "1 for the controller's current mode", ("mode",)),
    ("forecast", Gauge, "control_forecast_rps", "Arrivals/s forecast over the horizon", ()),
    ("capacity", Gauge, "control_capacity_rps", "Requests/s finished at full load", ()),
    (
        "shed_from",
        Gauge,
        "control_shed_from_rank",
        "The tier of this rank is shed (its shed share), every lower one refused (-1: none)",
        (),
    ),
    (
        "shed_share",
        Gauge,
        "control_shed_share",
        "The share of the shed tier's requests refused (0: none)",
        (),
    ),
    ("knobs", Gauge, "control_knob", "The scheduler knobs in force", ("knob",)),
    ("decisions", Counter, "control_decisions", "Decisions that changed something, by kind", ("kind",)),
    (
        "variant_requests",
        Counter,
        "variant_requests",
        "Requests routed per variant and tier",
        ("variant", "tier"),
    ),
)


class ControlMetrics:
    """The surge controller and the tiers' promises (`prefix` as for `TenantMetrics`): per tier, SLO attainment
    and goodput over the ledger's window and every outcome counted; the controller's mode, forecast, capacity,
    knobs and shed level; every decision it changed, by kind; requests per variant and tier. A gateway runs a
    controller per model: made with `per="model"`, each model's loop writes through `for_(model)`, its own
    series of every metric."""

    def __init__(self, r: CollectorRegistry, prefix: str, per: str | None = None) -> None:
        scope = [per] if per else []
        self.families: dict[str, Gauge | Counter] = {
            key: kind(f"{prefix}_{name}", documentation, [*scope, *labels], registry=r)
            for key, kind, name, documentation, labels in _CONTROL_FAMILIES
        }
        self.per = per
        self._bind(())

    def _bind(self, scope: tuple[str, ...]) -> None:
        views = {name: Scoped(metric, scope) for name, metric in self.families.items()}
        self.attainment, self.goodput, self.outcomes = (
            views["attainment"],
            views["goodput"],
            views["outcomes"],
        )
        self.arrivals = views["arrivals"]
        self.mode, self.forecast, self.capacity = views["mode"], views["forecast"], views["capacity"]
        self.shed_from, self.shed_share = views["shed_from"], views["shed_share"]
        self.knobs, self.decisions = views["knobs"], views["decisions"]
        self.variant_requests = views["variant_requests"]

    def for_(self, value: str) -> ControlMetrics:
        """The series of one `per` value (a model), sharing these metrics."""
        assert self.per is not None, "only metrics made with `per` have series per value"
        bound = copy.copy(self)
        bound._bind((value,))
        return bound


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("qpack_queue_depth", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("qpack_running_requests", "Requests in the running batch", registry=r)
        self.kv_blocks_used = Gauge("qpack_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.kv_blocks_total = Gauge("qpack_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_waste = Gauge(
            "qpack_kv_waste_ratio", "Allocated but unused KV slots / allocated slots", registry=r
        )
        self.prefix_hit_rate = Gauge("qpack_prefix_cache_hit_rate", "Prefix cache block hit rate", registry=r)
        self.ttft = Histogram(
            "qpack_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "qpack_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "qpack_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter("qpack_generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("qpack_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_prompt_tokens = Counter(
            "qpack_prompt_tokens_cached", "Prompt tokens served from the prefix cache", registry=r
        )
        self.requests = Counter(
            "qpack_requests", "Finished requests by reason", ["finish_reason"], registry=r
        )
        self.request_errors = Counter(
            "qpack_request_errors",
            "Requests finished with an error: scope request (its own sampling, stop matching or decoding "
            "failed; the rest of its step went on), scope step (a failure every row of the step shared)",
            ["scope"],
            registry=r,
        )
        self.rejected = Counter(
            "qpack_requests_rejected", "Requests rejected by back-pressure (429)", registry=r
        )
        self.preemptions = Counter(
            "qpack_preemptions", "Sequences preempted for lack of KV blocks", registry=r
        )
        self.steps = Counter("qpack_engine_steps", "Engine steps", registry=r)
        self.offload_hits = Counter(
            "qpack_kv_offload_hits", "Blocks found in a KV offload store", ["store"], registry=r
        )
        self.offload_misses = Counter(
            "qpack_kv_offload_misses", "Offload lookups that found nothing", registry=r
        )
        self.offload_written = Counter(
            "qpack_kv_offload_written", "Blocks written through to a KV offload store", ["store"], registry=r
        )
        self.offload_dropped = Counter(
            "qpack_kv_offload_dropped_writes", "Write-throughs dropped because the queue was full", registry=r
        )
        self.offload_corrupt = Counter(
            "qpack_kv_offload_corrupt_blocks",
            "Stored blocks refused (damaged, truncated, foreign)",
            ["store"],
            registry=r,
        )
        self.offload_load = Histogram(
            "qpack_kv_offload_load_seconds",
            "Time to load one lookup's blocks from the offload stores",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )

        self.speculation = SpeculationMetrics(r)

        self.tenants = TenantUsage(r, "qpack", "Time from arrival to a seat in the batch")

    def offload_event(self, event: str, store: str, value: float) -> None:
        """What the KV offload reports (any thread): `store` is host or disk."""
        if event == "hit":
            self.offload_hits.labels(store=store).inc(value)
        elif event == "miss":
            self.offload_misses.inc(value)
        elif event == "written":
            self.offload_written.labels(store=store).inc(value)
        elif event == "dropped":
            self.offload_dropped.inc(value)
        elif event == "corrupt":
            self.offload_corrupt.labels(store=store).inc(value)
        elif event == "load_seconds":
            self.offload_load.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Labelled:
    """A collector of several registries' metrics, each sample labelled with the name its registry is given
    (`variant`): one `/metrics` for several engines whose metrics share their names."""

    def __init__(self, label: str, registries: dict[str, CollectorRegistry]) -> None:
        self.label, self.registries = label, registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for value, registry in self.registries.items():
            for family in registry.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, self.label: value}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        return iter(families.values())


def render(*registries: CollectorRegistry) -> bytes:
    return b"".join(generate_latest(registry) for registry in registries)
