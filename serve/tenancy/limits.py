"""Rate limits as token buckets, and concurrency slots: the arithmetic, kept apart from where the state lives.

A tenant's `requests_per_minute` is a bucket holding up to that many requests, refilled continuously at a
sixtieth of it per second; each request takes one. `tokens_per_minute` is a bucket of tokens: at admission a
request takes its prompt plus its `max_tokens` (what it may cost at most), and when it ends the part it did not
generate goes back. `max_concurrent` caps the requests of a tenant in flight at once. The slot and the request are
decided together at the door (a refusal takes neither); the tokens once the prompt is tokenized.

`take` and `refill` are the whole model, pure, with the time passed in: `LocalLimiter` keeps the state in this
process (one server), `serve.tenancy.redis_limits` runs the same steps as Lua scripts inside Redis (a fleet with
several gateways), and a test holds the two to the same decisions on one trace. Each decision comes with
OpenAI's rate-limit headers (`x-ratelimit-limit-requests`, `-remaining-requests`, `-reset-requests` and the
`-tokens` ones) and, when refused, a `Retry-After`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.tenancy.tenants import Caller, Tenant


@dataclass(frozen=True)
class Bucket:
    """A token bucket: holds up to `capacity`, refills at `per_second`."""

    capacity: float
    per_second: float

    @classmethod
    def per_minute(cls, limit: float) -> Bucket:
        return cls(float(limit), float(limit) / 60.0)


@dataclass(frozen=True)
class Level:
    """A bucket's content `value` as of time `at` (seconds)."""

    value: float
    at: float


def refill(bucket: Bucket, level: Level | None, now: float) -> Level:
    """The level at `now`: full when never used; never refilled backwards when a clock steps back."""
    if level is None:
        return Level(bucket.capacity, now)
    if now <= level.at:
        return level
    return Level(min(bucket.capacity, level.value + (now - level.at) * bucket.per_second), now)


def take(bucket: Bucket, level: Level | None, amount: float, now: float) -> tuple[bool, Level]:
    """Take `amount`, all or nothing (a negative amount gives back, up to the capacity)."""
    current = refill(bucket, level, now)
    if amount > 0 and current.value < amount:
        return False, current
    return True, Level(min(bucket.capacity, current.value - amount), current.at)


def seconds_until(bucket: Bucket, level: Level, amount: float) -> float:
    """Seconds until the bucket holds `amount` (infinite when it never can)."""
    if amount > bucket.capacity:
        return math.inf
    return max(0.0, (amount - level.value) / bucket.per_second)


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: 20ms, 1.5s, 6m0s, 1h2m3s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole_minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(whole_minutes), 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def bucket_headers(kind: str, bucket: Bucket, level: Level) -> dict[str, str]:
    """OpenAI's headers for one bucket (`kind`: requests or tokens)."""
    return {
        f"x-ratelimit-limit-{kind}": str(int(bucket.capacity)),
        f"x-ratelimit-remaining-{kind}": str(max(0, int(level.value))),
        f"x-ratelimit-reset-{kind}": duration(seconds_until(bucket, level, bucket.capacity)),
    }


@dataclass(frozen=True)
class Verdict:
    """A limiter's answer: allowed, or which limit refused (`requests`, `tokens`, `concurrency`) and when trying
    again can succeed (`retry_after` seconds; infinite: never, the request itself is over the limit)."""

    allowed: bool
    limit: str | None = None
    retry_after: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def retry_after_header(self) -> dict[str, str]:
        if self.allowed or math.isinf(self.retry_after):
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


ALLOWED = Verdict(True)


def bucket_verdict(kind: str, bucket: Bucket, allowed: bool, level: Level, amount: float) -> Verdict:
    headers = bucket_headers(kind, bucket, level)
    if allowed:
        return Verdict(True, headers=headers)
    return Verdict(False, kind, seconds_until(bucket, level, amount), headers)


class LocalLimiter:
    """Every tenant's buckets and slots in this process (one server); thread-safe, clock injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._levels: dict[tuple[str, str], Level] = {}
        self._inflight: dict[str, dict[str, float]] = {}  # tenant -> {request id: when its slot lapses}

    def admit(self, tenant: Tenant, request_id: str, hold: float = 3600.0) -> Verdict:
        """A slot (`max_concurrent`) and one request from the `requests_per_minute` bucket, both or neither. A
        slot lapses after `hold` seconds (the request's timeout) even if it is never released."""
        limits = tenant.limits
        with self._lock:
            now = self.clock()
            held = self._inflight.setdefault(tenant.name, {})
            for lapsed in [r for r, until in held.items() if until <= now]:
                del held[lapsed]
            if limits.max_concurrent is not None and len(held) >= limits.max_concurrent:
                return Verdict(False, "concurrency", 1.0)
            verdict = ALLOWED
            if limits.requests_per_minute is not None:
                verdict = self._take(
                    tenant.name, "requests", Bucket.per_minute(limits.requests_per_minute), 1
                )
                if not verdict.allowed:
                    return verdict
            if limits.max_concurrent is not None:
                held[request_id] = now + hold
            return verdict

    def release(self, tenant: str, request_id: str) -> None:
        with self._lock:
            self._inflight.get(tenant, {}).pop(request_id, None)

    def reserve(self, caller: Caller, tokens: int) -> Verdict:
        """`tokens` (prompt + max_tokens) from the `tokens_per_minute` bucket."""
        if caller.tokens_per_minute is None:
            return ALLOWED
        with self._lock:
            return self._take(caller.tenant, "tokens", Bucket.per_minute(caller.tokens_per_minute), tokens)

    def refund(self, caller: Caller, tokens: int) -> None:
        """Give back what a request reserved and did not use."""
        if caller.tokens_per_minute is None or tokens <= 0:
            return
        with self._lock:
            self._take(caller.tenant, "tokens", Bucket.per_minute(caller.tokens_per_minute), -tokens)

    def _take(self, tenant: str, kind: str, bucket: Bucket, amount: float) -> Verdict:
        allowed, level = take(bucket, self._levels.get((tenant, kind)), amount, self.clock())
        self._levels[(tenant, kind)] = level
        return bucket_verdict(kind, bucket, allowed, level, amount)
