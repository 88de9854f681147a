"""Token buckets and concurrency slots on a simulated clock: refusals, refills, refunds and the headers a client
reads, compared with the numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from serve.tenancy.limits import Bucket, Level, LocalLimiter, bucket_headers, duration, take
from serve.tenancy.tenants import Caller, Limits, Tenant, Tier

FREE = Tier("free", 2, "flex")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str = "globex", **limits: float) -> Tenant:
    return Tenant(name, FREE, Limits(**limits))  # type: ignore[arg-type]


def test_a_bucket_empties_refills_and_never_overflows() -> None:
    bucket = Bucket.per_minute(8)  # 8 requests, one back every 7.5 s
    level = None
    for _ in range(8):
        allowed, level = take(bucket, level, 1, 0.0)
        assert allowed
    allowed, level = take(bucket, level, 1, 0.0)
    assert not allowed and level == Level(0.0, 0.0)
    assert not take(bucket, level, 1, 7.4)[0]
    allowed, level = take(bucket, level, 1, 7.5)
    assert allowed and level.value == pytest.approx(0.0)
    assert take(bucket, level, 0, 10_000.0)[1].value == 8.0  # capped at capacity
    assert take(bucket, Level(8.0, 0.0), -5, 1.0)[1].value == 8.0  # a refund never overflows either
    assert take(bucket, Level(2.0, 50.0), 0, 40.0)[1] == Level(2.0, 50.0)  # a clock stepping back: no refill


def test_headers_and_openai_durations() -> None:
    bucket = Bucket.per_minute(600)
    assert bucket_headers("requests", bucket, Level(590.6, 0.0)) == {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "590",
        "x-ratelimit-reset-requests": "940ms",
    }
    assert [duration(s) for s in (0.02, 1.5, 12.0, 360.0, 3723.25)] == [
        "20ms",
        "1.5s",
        "12s",
        "6m0s",
        "1h2m3.25s",
    ]


def test_requests_per_minute_refuses_with_the_wait_and_headers() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    globex, acme = tenant(requests_per_minute=8), tenant("acme", requests_per_minute=600)
    for index in range(8):
        verdict = limiter.admit(globex, f"r{index}")
        assert verdict.allowed and verdict.headers["x-ratelimit-remaining-requests"] == str(7 - index)
    refused = limiter.admit(globex, "r8")
    assert (refused.allowed, refused.limit) == (False, "requests")
    assert refused.retry_after == pytest.approx(7.5) and refused.retry_after_header == {"Retry-After": "8"}
    assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert limiter.admit(acme, "a0").allowed  # another tenant is unaffected
    clock.now += 7.5
    assert limiter.admit(globex, "r9").allowed


def test_tokens_are_reserved_and_the_unused_part_comes_back() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    caller = Caller("globex", "free", 2, "flex", tokens_per_minute=1000)
    assert limiter.reserve(caller, 600).headers["x-ratelimit-remaining-tokens"] == "400"
    refused = limiter.reserve(caller, 500)
    assert refused.limit == "tokens" and refused.retry_after == pytest.approx(
        6.0
    )  # 100 tokens at 1000/60 per s
    limiter.refund(caller, 550)  # the answer used 50 of the 600
    assert limiter.reserve(caller, 500).headers["x-ratelimit-remaining-tokens"] == "450"
    too_large = limiter.reserve(caller, 1001)
    assert math.isinf(too_large.retry_after) and too_large.retry_after_header == {}
    assert LocalLimiter(clock).reserve(Caller(), 10**9).allowed  # no limit, no bucket


def test_concurrency_slots_are_held_until_released_or_lapsed() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    globex = tenant(max_concurrent=2)
    assert limiter.admit(globex, "a", hold=60).allowed and limiter.admit(globex, "b", hold=60).allowed
    refused = limiter.admit(globex, "c", hold=60)
    assert (refused.allowed, refused.limit) == (False, "concurrency")
    limiter.release("globex", "a")
    assert limiter.admit(globex, "c", hold=60).allowed
    assert not limiter.admit(globex, "d", hold=60).allowed
    clock.now += 61  # b and c were never released (a crashed handler): their slots lapse
    assert limiter.admit(globex, "d", hold=60).allowed


def test_a_refused_slot_takes_no_request_from_the_bucket() -> None:
    clock = Clock()
    limiter = LocalLimiter(clock)
    globex = tenant(max_concurrent=1, requests_per_minute=2)
    assert limiter.admit(globex, "a").allowed
    assert limiter.admit(globex, "b").limit == "concurrency"
    limiter.release("globex", "a")
    assert limiter.admit(globex, "c").headers["x-ratelimit-remaining-requests"] == "0"  # b took nothing
