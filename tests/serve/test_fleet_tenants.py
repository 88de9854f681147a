"""Tenants in the fleet, on a real `redis-server`: the gateway stamps who is asking and workers act on the stamp
alone; limits hold across two gateways sharing one Redis; the Lua buckets decide exactly as the Python model does;
a Redis that cannot be asked refuses (503) rather than letting a limited tenant through."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from pathlib import Path

import httpx
import pytest
import redis

from serve.fleet import wire as P
from serve.fleet.local_redis import LocalRedis
from serve.http import free_port
from serve.openai import ServerInfo
from serve.tenancy.limits import Bucket, take
from serve.tenancy.redis_limits import LimiterUnavailable, RedisAdmission, RedisTokens
from serve.tenancy.tenants import Caller, Limits, Tenant, TenantsSource, Tier
from tests.serve.test_fleet import gateway, live_workers, local_redis, wait_for, worker

__all__ = ["local_redis"]  # the fixture, used by name

TENANTS = """\
[tenants.acme]
keys = ["key-tenant-a"]
tier = "priority"

[tenants.globex]
keys = ["key-tenant-b"]
tier = "free"

[tenants.hooli]
keys = ["key-tenant-d"]
tier = "free"
requests_per_minute = 4
max_concurrent = 1

[tenants.initech]
keys = ["key-tenant-c"]
tokens_per_minute = 300
"""
A, B, C, D = ({"Authorization": f"Bearer key-tenant-{x}"} for x in "abcd")
HISTORY = {
    "messages": [
        {
            "role": "user",
            "content": "Once upon a time there was a little girl who liked to play in the park.",
        },
        {
            "role": "assistant",
            "content": "She had a dog called Max who loved to run after the ball every day.",
        },
        {"role": "user", "content": "What did the girl and her dog do when it started to rain?"},
    ],
    "max_tokens": 2,
    "temperature": 0,
}


@pytest.fixture()
def tenants(tmp_path: Path) -> ServerInfo:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return ServerInfo("fleet", "", tenants=TenantsSource(path))


def post(base: str, key: dict[str, str], body: dict, path: str = "chat/completions") -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json=body, headers=key, timeout=60)


def test_the_gateway_stamps_the_tenant_and_workers_isolate_by_it(
    tiny_llama: Path, local_redis: LocalRedis, tenants: ServerInfo
) -> None:
    with (
        worker(tiny_llama, local_redis.url) as fleet_worker,
        gateway(local_redis.url, info=tenants) as base,
    ):
        wait_for(lambda: live_workers(base) == 1, what="the worker's heartbeat")
        assert post(base, {}, HISTORY).status_code == 401
        named = {**HISTORY, "user": "alice", "session_id": "s1"}
        first, second = post(base, A, named), post(base, A, named)
        assert first.status_code == 200 and first.json()["service_tier"] == "priority"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        foreign = post(base, B, {**HISTORY, "user": "alice", "service_tier": "priority"})
        assert foreign.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not A's KV
        assert foreign.json()["service_tier"] == "flex"  # asked up, ran at its own tier
        fleet_worker.engine.offload.manager.flush()  # type: ignore[union-attr]
        refused = httpx.delete(f"{base}/v1/sessions/s1", params={"user": "alice"}, headers=B)
        assert refused.status_code == 404
        deleted = httpx.delete(f"{base}/v1/sessions/s1", params={"user": "alice"}, headers=A)
        assert deleted.status_code == 200 and deleted.json()["blocks"] > 0, deleted.text
        again = httpx.delete(f"{base}/v1/sessions/s1", params={"user": "alice"}, headers=A)
        assert (again.status_code, again.json()) == (refused.status_code, refused.json())
        metrics = httpx.get(f"{base}/metrics").text
        assert 'qpack_fleet_tenant_requests_total{status="200",tenant="acme",tier="priority"} 2.0' in metrics
        assert 'qpack_fleet_tenant_tokens_total{kind="completion",tenant="globex",tier="free"}' in metrics
        assert "key-tenant" not in metrics


@pytest.fixture()
def tiered_worker_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers in this module keep KV offload stores (sessions are recorded only there)."""
    import tests.serve.test_fleet as fleet_tests
    from tests.serve.test_api import make_engine

    monkeypatch.setattr(
        fleet_tests,
        "make_engine",
        lambda model_dir, **kw: make_engine(model_dir, kv_host_memory=8 * 2**20, max_model_len=512, **kw),
    )


@pytest.fixture(autouse=True)
def _tiers(tiered_worker_engine: None) -> None:
    return None


def arrivals(base: str, tier: str) -> float:
    """The tier's arrivals the gateway's controllers counted, over all models."""
    found = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("qpack_fleet_control_arrivals_total{") and f'tier="{tier}"' in line:
            found += float(line.rsplit(" ", 1)[1])
    return found


def test_limits_hold_across_two_gateways_sharing_one_redis(
    tiny_llama: Path, local_redis: LocalRedis, tenants: ServerInfo
) -> None:
    with (
        worker(tiny_llama, local_redis.url) as fleet_worker,
        gateway(local_redis.url, info=tenants) as one,
        gateway(local_redis.url, info=tenants) as two,
    ):
        wait_for(lambda: live_workers(one) == 1 and live_workers(two) == 1, what="the worker's heartbeat")
        body = {"prompt": "Once upon a time", "max_tokens": 1}
        codes = [post(base, D, body, "completions").status_code for base in (one, two, one, two)]
        assert codes == [200, 200, 200, 200]
        refused = post(two, D, body, "completions")
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
        assert (
            refused.headers["x-ratelimit-limit-requests"] == "4" and int(refused.headers["retry-after"]) >= 1
        )
        assert post(one, D, body, "completions").status_code == 429  # the other gateway agrees
        assert post(one, A, body, "completions").status_code == 200  # another tenant goes on
        assert arrivals(one, "free") == 2 and arrivals(two, "free") == 2  # hooli's 429s are not demand
        client = redis.Redis.from_url(local_redis.url)
        client.delete("qpack:limit:hooli:requests")  # a fresh minute
        fleet_worker.engine.paused.set()  # hold hooli's one request in flight
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                held = pool.submit(post, one, D, body, "completions")
                wait_for(lambda: client.zcard("qpack:limit:hooli:inflight") == 1, what="a slot taken")
                busy = post(two, D, body, "completions")
                assert busy.status_code == 429 and "in flight" in busy.json()["error"]["message"]
                fleet_worker.engine.paused.clear()
                assert held.result().status_code == 200
        finally:
            fleet_worker.engine.paused.clear()
        wait_for(lambda: client.zcard("qpack:limit:hooli:inflight") == 0, what="the slot given back")


def test_workers_reserve_tokens_and_refuse_what_cannot_fit(
    tiny_llama: Path, local_redis: LocalRedis, tenants: ServerInfo
) -> None:
    with worker(tiny_llama, local_redis.url), gateway(local_redis.url, info=tenants) as base:
        wait_for(lambda: live_workers(base) == 1, what="the worker's heartbeat")
        body = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        first = post(base, C, body, "completions")
        assert first.status_code == 200, first.text
        reserved = first.json()["usage"]["prompt_tokens"] + 20
        assert int(first.headers["x-ratelimit-remaining-tokens"]) == pytest.approx(300 - reserved, abs=1)
        huge = post(base, C, {"prompt": list(range(100, 390)), "max_tokens": 20}, "completions")
        assert huge.status_code == 429 and "request too large" in huge.json()["error"]["message"]
        assert huge.headers["x-ratelimit-limit-tokens"] == "300" and "retry-after" not in huge.headers
        metrics = httpx.get(f"{base}/metrics").text
        assert (
            'qpack_fleet_tenant_rate_limited_total{limit="tokens",tenant="initech",tier="standard"} 1.0'
            in metrics
        )


def test_the_lua_buckets_decide_exactly_as_the_python_model(local_redis: LocalRedis) -> None:
    """A random trace of takes and refunds at given times, through Redis and through `limits.take`: the same
    decision and the same level (to the bit) at every step."""
    client = redis.Redis.from_url(local_redis.url)
    tokens = RedisTokens(client)
    caller = Caller("trace", tokens_per_minute=500.0)
    bucket, level = Bucket.per_minute(500.0), None
    rng = random.Random(7)
    now = 1_000_000.0
    for _step in range(300):
        now += rng.choice((0.0, 0.01, 0.37, 1.5, 4.0))
        amount = rng.choice((1, 17, 120, 260, 499, 501, -40))
        if amount < 0:
            pipe = client.pipeline()
            tokens._tokens(keys=["qpack:limit:trace:tokens"], args=[500.0, amount, repr(now)], client=pipe)
            pipe.execute()
            _allowed, level = take(bucket, level, amount, now)
            continue
        verdict = tokens.reserve(caller, amount, now=now)
        allowed, level = take(bucket, level, amount, now)
        assert verdict.allowed == allowed
        stored = client.hmget("qpack:limit:trace:tokens", "value", "at")
        assert (float(stored[0]), float(stored[1])) == (level.value, level.at)


def test_limits_fail_closed_when_redis_cannot_be_asked() -> None:
    import redis.asyncio as aioredis

    closed = f"redis://127.0.0.1:{free_port()}/0"
    limited = Tenant("hooli", Tier("free", 2, "flex"), Limits(requests_per_minute=4))

    async def admit() -> None:
        client = aioredis.Redis.from_url(closed, socket_connect_timeout=1)
        try:
            assert (
                await RedisAdmission(client).admit(Tenant("free-for-all", limited.tier), "r", 0.0)
            ).allowed
            await RedisAdmission(client).admit(limited, "r", 0.0)
        finally:
            await client.aclose()

    with pytest.raises(LimiterUnavailable):
        asyncio.run(admit())
    with pytest.raises(LimiterUnavailable):
        RedisTokens(redis.Redis.from_url(closed, socket_connect_timeout=1)).reserve(
            Caller(tokens_per_minute=10), 5
        )


def test_a_worker_refuses_an_unstamped_request(tiny_llama: Path, local_redis: LocalRedis) -> None:
    """Only a gateway's stamp says who is asking: an entry without one is answered with an error, never served as
    some default tenant."""
    with worker(tiny_llama, local_redis.url):
        client = redis.Redis.from_url(local_redis.url)
        request = P.FleetRequest("cmpl-x", "tiny", False, {"prompt": "hi", "max_tokens": 1}, 1, 2e9)
        wait_for(lambda: client.exists(P.model_stream("tiny")) == 1, what="the worker's groups")
        client.xadd(P.model_stream("tiny"), request.encode())
        wait_for(lambda: client.xlen(P.response_stream("cmpl-x")) == 1, what="the answer")
        ((_id, fields),) = client.xrange(P.response_stream("cmpl-x"))
        chunk = P.Chunk.decode(fields)
        assert chunk.kind == "error" and chunk.status == 500 and "stamp" in str(chunk.error)
