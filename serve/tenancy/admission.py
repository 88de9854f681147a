"""A request at the door, the same wherever it arrives: its tenant's limits applied and refused the way OpenAI
refuses (429, `Retry-After`, the `x-ratelimit-*` headers, an error of type `requests` or `tokens`).

In a single server all of it happens in the one process (`Door` over a `LocalLimiter`): a concurrency slot and a
request before the prompt is tokenized, then prompt + max_tokens from the token bucket, and at the end the slot
back and the tokens the answer did not use. In a fleet the gateway takes the slot and the request
(`redis_limits.RedisAdmission`) and the worker, which tokenizes, the tokens (`redis_limits.RedisTokens`); both
build their refusals and sampling limits here.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serve.refusal import Refusal
from serve.tenancy.limits import LocalLimiter, Verdict
from serve.tenancy.tenants import Caller, Tenant

if TYPE_CHECKING:
    from serve.metrics import TenantMetrics


def refusal(verdict: Verdict, tenant: str, requested: int = 0) -> Refusal:
    """The refusal for a limit that refused (`requested`: the tokens asked, for a token refusal): over_limit,
    with the tenant's limit state and when to retry (HTTP: a 429)."""
    limit = verdict.limit or "requests"
    if limit == "concurrency":
        message = f"tenant {tenant!r} has as many requests in flight as it may (max_concurrent); retry when one ends"
    elif math.isinf(verdict.retry_after):
        allowed = verdict.headers.get("x-ratelimit-limit-tokens", "?")
        message = (
            f"request too large for tenant {tenant!r} on tokens per minute: limit {allowed}, requested "
            f"{requested} (prompt + max_tokens); lower max_tokens or shorten the prompt"
        )
    else:
        message = f"rate limit reached for tenant {tenant!r} on {limit} per minute; retry in {math.ceil(verdict.retry_after)} s"
    return Refusal(
        "over_limit",
        message,
        code="rate_limit_exceeded",
        kind=limit,
        retry_after=verdict.retry_after,
        limits=verdict.headers,
    )


@dataclass
class Ticket:
    """One request's hold on its tenant's limits, from the door to its last byte: closed exactly once."""

    tenant: Tenant
    caller: Caller
    request_id: str
    reserved: int = 0  # prompt + max_tokens taken from the token bucket
    prompt_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* of the decisions taken
    closed: bool = False


class Door:
    """The single server's door over one `LocalLimiter`; refusals are counted per tenant and tier."""

    def __init__(self, limiter: LocalLimiter, metrics: TenantMetrics, hold: float = 3600.0) -> None:
        self.limiter, self.metrics, self.hold = limiter, metrics, hold
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant, caller: Caller, request_id: str) -> Ticket:
        """A slot and a request, or a Refusal (over_limit). The slot lapses after `hold` seconds if never given
        back."""
        verdict = self.limiter.admit(tenant, request_id, self.hold)
        if not verdict.allowed:
            raise self._refused(verdict, caller)
        return Ticket(tenant, caller, request_id, headers=dict(verdict.headers))

    def reserve(self, ticket: Ticket, prompt_tokens: int, max_tokens: int) -> None:
        """prompt + max_tokens from the token bucket, or a Refusal (over_limit)."""
        wanted = prompt_tokens + max_tokens
        verdict = self.limiter.reserve(ticket.caller, wanted)
        if not verdict.allowed:
            raise self._refused(verdict, ticket.caller, wanted)
        ticket.reserved, ticket.prompt_tokens = (
            wanted if ticket.caller.tokens_per_minute else 0,
            prompt_tokens,
        )
        ticket.headers.update(verdict.headers)

    def close(self, ticket: Ticket, completion_tokens: int, ran: bool = True) -> None:
        """The request is over, however it ended: its slot back, and the tokens it reserved and did not use (all
        of them when it never `ran`: refused before the engine took it)."""
        with self._lock:
            if ticket.closed:
                return
            ticket.closed = True
        self.limiter.release(ticket.tenant.name, ticket.request_id)
        used = ticket.prompt_tokens + completion_tokens if ran else 0
        if ticket.reserved:
            self.limiter.refund(ticket.caller, ticket.reserved - used)

    def _refused(self, verdict: Verdict, caller: Caller, requested: int = 0) -> Refusal:
        self.metrics.rate_limited.labels(caller.tenant, caller.tier, verdict.limit or "").inc()
        return refusal(verdict, caller.tenant, requested)
