"""Prometheus metrics of the serving engine, in a registry of its own (several engines can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class TenantMetrics:
    """Per tenant and tier, in a server's registry or a fleet gateway's (`prefix`): requests by HTTP status,
    refusals by the limit that refused, tokens, queue time (`queue_help` says from when to when), and reloads
    of the tenants file. Labels are tenant and tier names from that file, never key material."""

    def __init__(self, r: CollectorRegistry, prefix: str, queue_help: str) -> None:
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
        self.reloads = Counter(
            f"{prefix}_tenants_reloads", "Tenants file reloads (SIGHUP) by outcome", ["outcome"], registry=r
        )

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("ok" if ok else "failed").inc()


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
        self.rejected = Counter(
            "qpack_requests_rejected", "Requests rejected by back-pressure (429)", registry=r
        )
        self.preemptions = Counter(
            "qpack_preemptions", "Sequences preempted for lack of KV blocks", registry=r
        )
        self.steps = Counter("qpack_engine_steps", "Engine steps", registry=r)
        self.tier_hits = Counter("qpack_kv_tier_hits", "Blocks found in a tier", ["tier"], registry=r)
        self.tier_misses = Counter("qpack_kv_tier_misses", "Tier lookups that found nothing", registry=r)
        self.tier_written = Counter(
            "qpack_kv_tier_written", "Blocks written through to a tier", ["tier"], registry=r
        )
        self.tier_dropped = Counter(
            "qpack_kv_tier_dropped_writes", "Write-throughs dropped because the queue was full", registry=r
        )
        self.tier_corrupt = Counter(
            "qpack_kv_tier_corrupt_blocks",
            "Stored blocks refused (damaged, truncated, foreign)",
            ["tier"],
            registry=r,
        )
        self.tier_load = Histogram(
            "qpack_kv_tier_load_seconds",
            "Time to load one lookup's blocks from the tiers",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )

        self.tenants = TenantMetrics(r, "qpack", "Time from arrival to a seat in the batch")

    def tier_event(self, event: str, tier: str, value: float) -> None:
        """What the tiers report (any thread)."""
        if event == "hit":
            self.tier_hits.labels(tier=tier).inc(value)
        elif event == "miss":
            self.tier_misses.inc(value)
        elif event == "written":
            self.tier_written.labels(tier=tier).inc(value)
        elif event == "dropped":
            self.tier_dropped.inc(value)
        elif event == "corrupt":
            self.tier_corrupt.labels(tier=tier).inc(value)
        elif event == "load_seconds":
            self.tier_load.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
