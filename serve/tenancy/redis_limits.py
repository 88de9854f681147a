"""The tenants' limits kept in Redis, so that they hold across several gateways and workers of one fleet.

The token-bucket steps of `serve.tenancy.limits.take` run as Lua inside Redis: one script call reads, refills,
decides and writes a bucket atomically, so two gateways admitting the same tenant at the same instant can never
both take its last request. Time is Redis's own clock (`TIME`), one clock for every gateway whatever theirs say;
tests pass it in to replay a trace. Concurrency slots are a sorted set per tenant of request id -> expiry (the
request's deadline), so a gateway that dies holding slots frees them at their deadlines instead of leaking them.

Gateways (asyncio) decide admission: a slot and a request (`RedisAdmission`). Workers, which alone know a prompt's
token count, reserve tokens (`RedisTokens`) and give the unused part back as the answer's last chunk is written.
When Redis cannot be asked, limits fail closed: `LimiterUnavailable`, a 503, never an unlimited request.
"""

from __future__ import annotations

import contextlib
from typing import Any

from serve.tenancy.limits import ALLOWED, Bucket, Level, Verdict, bucket_verdict
from serve.tenancy.tenants import Caller, Tenant

PREFIX = "qpack:limit:"

_TAKE = """
local function take(key, cap, rate, amount, now)
  local state = redis.call('HMGET', key, 'value', 'at')
  local value, at = tonumber(state[1]), tonumber(state[2])
  if not value then
    value, at = cap, now
  elseif now > at then
    value, at = math.min(cap, value + (now - at) * rate), now
  end
  local allowed = 1
  if amount > 0 and value < amount then allowed = 0 else value = math.min(cap, value - amount) end
  redis.call('HSET', key, 'value', string.format('%.17g', value), 'at', string.format('%.17g', at))
  redis.call('PEXPIRE', key, math.ceil((cap - value) / rate * 1000) + 60000)
  return {allowed, string.format('%.17g', value), string.format('%.17g', at)}
end
local function clock(given)
  local now = tonumber(given)
  if now then return now end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# KEYS: in-flight set, requests bucket. ARGV: max_concurrent (0: none), request id, slot expiry (unix s),
# requests per minute (0: none), now ('': Redis's clock). Returns {verdict, value, at}.
ADMIT = (
    _TAKE
    + """
local now = clock(ARGV[5])
local max, rpm = tonumber(ARGV[1]), tonumber(ARGV[4])
if max > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max then return {'concurrency', '0', '0'} end
end
local result = {'ok', '0', '0'}
if rpm > 0 then
  local taken = take(KEYS[2], rpm, rpm / 60, 1, now)
  if taken[1] == 0 then return {'requests', taken[2], taken[3]} end
  result = {'ok', taken[2], taken[3]}
end
if max > 0 then
  redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), ARGV[2])
  redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[3])) + 60)
end
return result
"""
)

# KEYS: tokens bucket. ARGV: tokens per minute, amount (negative: give back), now. Returns {allowed, value, at}.
TOKENS = (
    _TAKE
    + "\nreturn take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[1]) / 60, tonumber(ARGV[2]), clock(ARGV[3]))\n"
)


class LimiterUnavailable(Exception):
    """Redis could not be asked: the request is refused (503), never let through unlimited."""


def inflight_key(tenant: str) -> str:
    return f"{PREFIX}{tenant}:inflight"


def bucket_key(tenant: str, kind: str) -> str:
    return f"{PREFIX}{tenant}:{kind}"


def _level(reply: list[Any]) -> Level:
    return Level(float(_text(reply[1])), float(_text(reply[2])))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisAdmission:
    """A gateway's door: a concurrency slot and one request of the tenant's bucket, decided in Redis."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._admit = client.register_script(ADMIT)

    async def admit(
        self, tenant: Tenant, request_id: str, expires_at: float, now: float | None = None
    ) -> Verdict:
        limits = tenant.limits
        if limits.max_concurrent is None and limits.requests_per_minute is None:
            return ALLOWED
        args = [
            limits.max_concurrent or 0,
            request_id,
            expires_at,
            limits.requests_per_minute or 0,
            "" if now is None else repr(now),
        ]
        try:
            reply = await self._admit(
                keys=[inflight_key(tenant.name), bucket_key(tenant.name, "requests")], args=args
            )
        except Exception as exc:
            raise LimiterUnavailable(str(exc)) from exc
        outcome = _text(reply[0])
        if outcome == "concurrency":
            return Verdict(False, "concurrency", 1.0)
        if limits.requests_per_minute is None:
            return ALLOWED
        bucket = Bucket.per_minute(limits.requests_per_minute)
        return bucket_verdict("requests", bucket, outcome == "ok", _level(reply), 1)

    async def release(self, tenant: Tenant, request_id: str) -> None:
        if tenant.limits.max_concurrent is None:
            return
        with contextlib.suppress(Exception):  # else the slot lapses at the request's deadline
            await self.client.zrem(inflight_key(tenant.name), request_id)


class RedisTokens:
    """A worker's token reservations in the tenant's `tokens_per_minute` bucket."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._tokens = client.register_script(TOKENS)

    def reserve(self, caller: Caller, tokens: int, now: float | None = None) -> Verdict:
        if caller.tokens_per_minute is None:
            return ALLOWED
        try:
            reply = self._tokens(
                keys=[bucket_key(caller.tenant, "tokens")], args=self._args(caller, tokens, now)
            )
        except Exception as exc:
            raise LimiterUnavailable(str(exc)) from exc
        bucket = Bucket.per_minute(caller.tokens_per_minute)
        return bucket_verdict("tokens", bucket, int(reply[0]) == 1, _level(reply), tokens)

    def refund(self, pipe: Any, caller: Caller, tokens: int) -> None:
        """Queue the return of `tokens` unused tokens on `pipe` (the pipeline that writes the answer's end)."""
        if caller.tokens_per_minute is None or tokens <= 0:
            return
        self._tokens(
            keys=[bucket_key(caller.tenant, "tokens")], args=self._args(caller, -tokens, None), client=pipe
        )

    @staticmethod
    def _args(caller: Caller, amount: int, now: float | None) -> list[Any]:
        return [caller.tokens_per_minute, amount, "" if now is None else repr(now)]
