"""The fleet's front door: the OpenAI API with no model loaded, in front of Redis and any number of workers.

Per request: the same guard and validation as `qpack serve` (the API key names the tenant, body size, every
field checked), the tenant's concurrency and request limits decided in Redis (so they hold across gateways; a
Redis that cannot be asked refuses the request, 503, rather than letting it through unlimited), the caller's
identity and tier stamped on the queued request (workers trust only that stamp), then a concrete seed (so a regeneration after a worker's death reproduces the same tokens), a deadline, and a target
stream. Routing: a request with a session (`session_id`, else `user`, else the start of its prompt, standing
for its first prefix block) goes to the live worker that a consistent-hash ring over the model's live workers
assigns it, where its KV is most likely still cached; when that worker is full or gone it goes to the model's
shared stream, which whichever worker has room reads first (the least loaded, in effect). The gateway then
reads the request's response stream, forwarding each chunk whose token count is past what the client already
has: a regenerated answer resumes the client's stream with no duplicate and no gap, and is answered once.

Back-pressure and health: 429 + Retry-After when the model's undelivered requests exceed `max_queue`; 503 +
Retry-After when no live worker serves the model or Redis cannot be reached (a Redis outage during a request is
waited out, with backoff, until the request's deadline). `/v1/models` lists what live workers announce;
`/metrics` has queue depth, per-worker load and failures.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from serve.control.loop import ControlLoop
from serve.core.config import SCHEDULER_DEFAULTS
from serve.fleet import wire as P
from serve.fleet.control import FleetControl
from serve.fleet.reader import ReaderClosed, ResponseReader
from serve.metrics import ControlMetrics, TenantMetrics, TenantUsage
from serve.openai import render, schema
from serve.openai.answers import Piece, disconnected, sse_events
from serve.openai.errors import internal_error
from serve.openai.protocol import (
    ApiError,
    GenerationRequest,
    http_error,
    parse_json,
    parse_request,
    session_label,
)
from serve.openai.routes import Guard, ServerInfo, error_response, fastapi_app, session_not_found
from serve.refusal import Refusal
from serve.tenancy.admission import refusal
from serve.tenancy.redis_limits import LimiterUnavailable, RedisAdmission
from serve.tenancy.tenants import Caller, Tenant

_log = logging.getLogger("qpack.fleet")


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    max_queue: int = SCHEDULER_DEFAULTS.max_queue  # undelivered requests of a model before 429
    request_timeout: float = 600.0
    info: ServerInfo = field(default_factory=lambda: ServerInfo("fleet", ""))  # its `control`: the controller


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge(
            "qpack_fleet_queue_depth", "Requests queued, not yet taken", ["model"], registry=r
        )
        self.worker_load = Gauge(
            "qpack_fleet_worker_load", "Requests in flight per worker", ["worker"], registry=r
        )
        self.workers = Gauge("qpack_fleet_live_workers", "Live workers", ["model"], registry=r)
        self.requests = Counter("qpack_fleet_requests", "Requests by outcome", ["outcome"], registry=r)
        self.regenerations = Counter(
            "qpack_fleet_regenerations", "Answers resumed from another worker after one died", registry=r
        )
        self.redis_errors = Counter("qpack_fleet_redis_errors", "Redis calls that failed", registry=r)
        self.tenants = TenantMetrics(r, "qpack_fleet")
        self.usage = TenantUsage(r, "qpack_fleet", "Time from a request's arrival to a worker accepting it")

    def outcome(self, status: int | str, caller: Caller | None, tenant: Tenant) -> None:
        """One answered request: its status, overall and for its tenant and tier."""
        self.requests.labels(outcome=str(status)).inc()
        tier = caller.tier if caller is not None else tenant.tier.name
        self.tenants.requests.labels(tenant.name, tier, str(status)).inc()


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        import redis.asyncio as aioredis

        self.config = config
        self.redis = aioredis.Redis.from_url(config.redis_url, socket_timeout=5, socket_connect_timeout=3)
        self.metrics = GatewayMetrics()
        self.admission = RedisAdmission(self.redis)
        self.control = FleetControl(
            self.redis,
            config.info.control,
            config.info.tenants,
            ControlMetrics(self.metrics.registry, "qpack_fleet", per="model"),
        )
        self._workers: tuple[float, list[P.WorkerInfo]] = (0.0, [])
        self._depth: dict[str, tuple[float, int, int]] = {}
        self.reader: ResponseReader | None = (
            None  # made on first use, inside the server's event loop  # model -> (measured at, depth, queued since)
        )

    async def live_workers(self) -> list[P.WorkerInfo]:
        """Workers whose heartbeat is fresh (cached for half a second)."""
        cached_at, workers = self._workers
        if time.monotonic() - cached_at < 0.5:
            return workers
        ids = [P.text(v) for v in await self.redis.hkeys(P.WORKERS)]
        pipe = self.redis.pipeline()
        for worker_id in ids:
            pipe.hgetall(P.worker_key(worker_id))
        found = [P.WorkerInfo.parse(fields) for fields in await pipe.execute()]
        now = time.time()
        workers = [w for w in found if w is not None and now - w.last_seen < 5.0]
        self._workers = (time.monotonic(), workers)
        for worker in workers:
            self.metrics.worker_load.labels(worker=worker.worker_id).set(worker.load)
        return workers

    def fingerprint(self, worker_id: str) -> str | None:
        """The variant a worker serves, as OpenAI's `system_fingerprint` (None for a worker not seen live)."""
        return next((w.fingerprint for w in self._workers[1] if w.worker_id == worker_id), None)

    async def run_control(self) -> None:
        """Tick the controller for the gateway's lifetime; a Redis outage skips ticks, never ends the loop."""
        tick = self.config.info.control.tick if self.config.info.control is not None else 0.5
        while True:
            await asyncio.sleep(tick)
            try:
                await self.control.tick(await self.live_workers())
            except Exception as exc:  # Redis away: the door answers 503 meanwhile
                self.metrics.redis_errors.inc()
                _log.debug("fleet control tick skipped: %r", exc)

    async def queue_depth(self, model: str) -> int:
        """Entries of the model's streams that no worker has taken yet, measured at most every 0.2 s (one
        round trip over all its streams), plus what this gateway queued since."""
        measured_at, depth, added = self._depth.get(model, (0.0, 0, 0))
        if time.monotonic() - measured_at < 0.2:
            return depth + added
        depth = await self.measure_depth(model)
        self._depth[model] = (time.monotonic(), depth, 0)
        return depth

    def queued(self, model: str) -> None:
        measured_at, depth, added = self._depth.get(model, (0.0, 0, 0))
        self._depth[model] = (measured_at, depth, added + 1)

    async def measure_depth(self, model: str) -> int:
        """Length less pending entries over the model's streams, its variants' shared ones and its workers' own
        (workers delete what they answered, so a stream holds only queued and in-flight requests)."""
        workers = [w for w in await self.live_workers() if w.model == model]
        variants = sorted({w.variant_name for w in workers} | {model})
        streams = [*(P.model_stream(b) for b in variants), *(P.worker_stream(w.worker_id) for w in workers)]
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
            pipe.xpending(stream, P.GROUP)
        replies = await pipe.execute(raise_on_error=False)
        depth = 0
        for length, pending in zip(replies[::2], replies[1::2], strict=True):
            taken = pending.get("pending", 0) if isinstance(pending, dict) else 0
            depth += max(0, int(length) - int(taken)) if isinstance(length, int) else 0
        self.metrics.queue_depth.labels(model=model).set(depth)
        return depth

    def route(self, request: P.FleetRequest, workers: list[P.WorkerInfo]) -> str:
        """The session's worker on the consistent-hash ring, when it has room; else the shared stream."""
        owner = ring_owner(request.session, workers) if request.session else None
        if owner is None or owner.room <= 0:
            return P.model_stream(request.variant or request.model)
        return P.worker_stream(owner.worker_id)

    async def submit(
        self, body: dict[str, Any], chat: bool, tenant: Tenant
    ) -> tuple[P.FleetRequest, GenerationRequest, Caller, dict[str, str]]:
        """Validate, admit within the tenant's limits, stamp and queue one request; its caller and the
        x-ratelimit-* headers of the admission. Raises ApiError or a Refusal (what the client gets)."""
        parsed = parse_request(body, chat)
        caller = self.config.info.tenants.current.caller(tenant, parsed.service_tier)
        workers = await self.live_workers()
        model, pinned = _model_of(body.get("model"), workers)
        control = self.control.loop_for(model, workers)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        deadline = time.time() + self.config.request_timeout
        headers = await self._admit(tenant, caller, request_id, deadline)
        try:
            control.arrived(caller)
            refusal = control.refusal(caller)
            if refusal is not None:
                raise refusal
            variant = control.variant_for(caller, pinned).variant
            serving = _serving(workers, model, variant)
            if await self.queue_depth(model) >= self.config.max_queue:
                raise ApiError(
                    429,
                    f"the fleet queue for {model} is full; retry later",
                    code="queue_full",
                    kind="rate_limit_error",
                )
            request = P.FleetRequest(
                request_id=request_id,
                model=model,
                chat=chat,
                body={k: v for k, v in body.items() if k != "model"},
                seed=parsed.seed if parsed.seed is not None else P.new_seed(),
                deadline=deadline,
                priority=parsed.priority,
                session=_session(caller.tenant, parsed),
                caller=caller.to_json(),
                variant=serving[0].variant_name,
            )
            await self.redis.xadd(self.route(request, serving), request.encode())
        except BaseException:
            await self.admission.release(tenant, request_id)
            raise
        self.queued(model)
        self.control.queued(request.variant, caller.tier, +1)
        return request, parsed, caller, {**headers, "x-qpack-variant": request.variant}

    async def _admit(
        self, tenant: Tenant, caller: Caller, request_id: str, deadline: float
    ) -> dict[str, str]:
        """The tenant's slot and request, decided in Redis (shared by every gateway); fails closed. It comes
        before the controller hears of the request: a tenant's own 429s are never arrivals of its tier."""
        try:
            verdict = await self.admission.admit(tenant, request_id, deadline + 60)
        except LimiterUnavailable as exc:
            self.metrics.redis_errors.inc()
            raise ApiError(
                503, "rate limits cannot be checked (Redis unreachable); retry", kind="unavailable"
            ) from exc
        if not verdict.allowed:
            self.metrics.tenants.rate_limited.labels(caller.tenant, caller.tier, verdict.limit or "").inc()
            raise refusal(verdict, caller.tenant)
        return verdict.headers

    async def chunks(self, request: P.FleetRequest, tenant: Tenant) -> AsyncGenerator[P.Chunk, None]:
        """The request's answer, each token once, across the attempts that wrote it (`wire.Chain`); the
        tenant's concurrency slot is given back when it ends, however it ends."""
        stream = P.response_stream(request.request_id)
        if self.reader is None:
            self.reader = ResponseReader(self.config.redis_url, self.redis)
        reader = self.reader
        chain, workers = P.Chain(), set()
        try:
            try:
                await reader.open(stream)
            except ReaderClosed:
                yield P.Chunk(
                    "error",
                    status=503,
                    error={"message": "the gateway is shutting down; retry", "type": "unavailable"},
                )
                return
            while True:
                fields = await reader.next(stream, max(0.0, request.deadline - time.time()))
                if fields is None:
                    yield P.Chunk(
                        "error", status=504, error={"message": "request timed out", "type": "timeout"}
                    )
                    return
                chunk = P.Chunk.decode(fields)
                workers.add(chunk.worker)
                if not chain.take(chunk):
                    continue
                if chunk.kind in ("done", "error"):
                    if len(workers) > 1:
                        self.metrics.regenerations.inc()
                    yield chunk
                    return
                yield chunk
        finally:
            reader.close(stream)
            await self._forget(request)
            await self.admission.release(tenant, request.request_id)

    async def forget_sessions(
        self, tenant: str, user: str | None, session_id: str | None, wait: float = 3.0
    ) -> tuple[int | None, int, int]:
        """Ask every live worker to delete the tenant's session's (or user's) KV and wait up to `wait` seconds for
        their answers: (blocks removed, None when no worker that answered had such a session; workers asked;
        workers that did not answer in time, which still apply it when they read it)."""
        reply = P.forget_reply_stream(uuid.uuid4().hex)
        try:
            workers = await self.live_workers()
            pipe = self.redis.pipeline(transaction=False)
            record = P.forget_record(tenant, user, session_id, time.time())
            pipe.xadd(P.FORGETS, record, maxlen=P.FORGETS_KEPT, approximate=True)
            for worker in workers:
                pipe.xadd(P.worker_stream(worker.worker_id), P.forget_entry(tenant, user, session_id, reply))
            await pipe.execute()
            answers = await self._answers(reply, len(workers), wait)
        except Exception as exc:
            self.metrics.redis_errors.inc()
            raise ApiError(
                503, "the fleet's queue (Redis) is unreachable; retry", kind="unavailable"
            ) from exc
        found = [blocks for blocks in answers if blocks >= 0]
        return (sum(found) if found else None), len(workers), len(workers) - len(answers)

    async def admit_deletion(self, tenant: Tenant) -> tuple[str, dict[str, str]]:
        """A session deletion's request and slot in the tenant's limits (as a completion's): its id to release
        and the x-ratelimit-* headers, or ApiError 429 (503 when Redis cannot be asked)."""
        caller = self.config.info.tenants.current.caller(tenant, None)
        request_id = f"del-{uuid.uuid4().hex}"
        return request_id, await self._admit(tenant, caller, request_id, time.time())

    async def _answers(self, reply: str, expected: int, wait: float) -> list[int]:
        """The blocks each worker reports on `reply`, until all `expected` answered or `wait` passed."""
        answers: list[int] = []
        last: bytes | str = "0-0"
        deadline = time.monotonic() + wait
        try:
            while len(answers) < expected and (left := deadline - time.monotonic()) > 0:
                found = await self.redis.xread({reply: last}, block=max(1, int(left * 1000)))
                for _stream, entry_id, fields in P.stream_entries(found):
                    last = entry_id
                    answers.append(int(P.text(fields.get(b"blocks", fields.get("blocks", b"-1")))))
        finally:
            await self.redis.delete(reply)
        return answers

    async def _forget(self, request: P.FleetRequest) -> None:
        try:
            await self.redis.delete(P.response_stream(request.request_id))
        except Exception:  # it expires on its own
            self.metrics.redis_errors.inc()

    async def cancel(self, request: P.FleetRequest) -> None:
        try:
            await self.redis.set(P.cancel_key(request.request_id), b"1", ex=600)
        except Exception:
            self.metrics.redis_errors.inc()


def ring_owner(session: str, workers: list[P.WorkerInfo], points: int = 64) -> P.WorkerInfo | None:
    """The worker owning `session` on a consistent-hash ring (`points` per worker): a worker joining or leaving
    moves only the sessions it takes or held, so KV caches elsewhere stay warm."""
    if not workers:
        return None
    ring = sorted(
        ((_point(f"{w.worker_id}#{v}"), w) for w in workers for v in range(points)), key=lambda p: p[0]
    )
    index = bisect.bisect([point for point, _ in ring], _point(session)) % len(ring)
    return ring[index][1]


def _point(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _model_of(named: object, workers: list[P.WorkerInfo]) -> tuple[str, str | None]:
    """The model a request's `model` asks for, and the variant it pins when it names one (503 when no live
    worker serves it)."""
    models = sorted({w.model for w in workers})
    if named is None and len(models) == 1:
        return models[0], None
    if named in models:
        return str(named), None
    pinned = next((w for w in workers if w.variant_name == named), None)
    if pinned is not None:
        return pinned.model, pinned.variant_name
    name = named or "any model"
    raise ApiError(
        503,
        f"no live worker serves {name} (models: {', '.join(models) or 'none'})",
        "model",
        kind="unavailable",
    )


def _serving(workers: list[P.WorkerInfo], model: str, variant: str) -> list[P.WorkerInfo]:
    """The live workers of `variant`; when none is left, those of the model's most accurate variant."""
    mine = sorted((w for w in workers if w.model == model), key=lambda w: w.kl)
    return [w for w in mine if w.variant_name == variant] or [
        w for w in mine if w.variant_name == mine[0].variant_name
    ]


def _session(tenant: str, parsed: GenerationRequest) -> str | None:
    """What routes a request to the worker holding its KV: the tenant's session, user, or the prompt's start."""
    if parsed.session_id or parsed.user:
        return f"{tenant}/{parsed.user or ''}/{parsed.session_id or ''}"
    text = (
        parsed.prompt if isinstance(parsed.prompt, str) else (parsed.messages or [{}])[0].get("content", "")
    )
    return f"{tenant}/prefix/{hashlib.sha256(str(text)[:256].encode()).hexdigest()}" if text else None


def create_gateway_app(gateway: Gateway) -> FastAPI:
    info = gateway.config.info
    state = {"draining": False}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ticking = asyncio.create_task(gateway.run_control())
        yield
        ticking.cancel()
        state["draining"] = True
        if gateway.reader is not None:
            await gateway.reader.aclose()
        await gateway.redis.aclose()

    app = fastapi_app("qpack fleet gateway", info, lifespan=lifespan)
    app.state.start_draining = lambda: state.update(draining=True)
    app.add_middleware(Guard, info=info, draining=lambda: state["draining"])
    app.add_exception_handler(Exception, internal_error)

    @app.post("/v1/completions", openapi_extra=schema.generation(chat=False))
    async def completions(request: Request) -> Response:
        return await _respond(gateway, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=schema.generation(chat=True))
    async def chat_completions(request: Request) -> Response:
        return await _respond(gateway, request, chat=True)

    @app.delete("/v1/sessions/{session_id}", openapi_extra=schema.sessions(one=True))
    async def delete_session(request: Request) -> Response:
        """A privacy request, passed to every live worker (each holds its own sessions' KV), scoped to the
        caller's tenant: another tenant's session is a 404, like one that never existed."""
        user, session_id = request.query_params.get("user"), request.path_params["session_id"]
        return await _forget(gateway, request.state.tenant, user, session_id)

    @app.delete("/v1/sessions", openapi_extra=schema.sessions(one=False))
    async def delete_user_sessions(request: Request) -> Response:
        return await _forget(gateway, request.state.tenant, request.query_params.get("user"), None)

    @app.get("/v1/models", openapi_extra=schema.models())
    async def models() -> dict[str, Any]:
        return _models(await gateway.live_workers())

    @app.get("/health", openapi_extra=schema.health())
    async def health() -> Response:
        try:
            await gateway.redis.ping()
            workers = await gateway.live_workers()
        except Exception:
            return JSONResponse({"status": "redis unreachable"}, status_code=503)
        if state["draining"] or not workers:
            return JSONResponse(
                {"status": "draining" if state["draining"] else "no workers"}, status_code=503
            )
        return JSONResponse({"status": "ok", "workers": len(workers)})

    @app.get("/metrics", openapi_extra=schema.metrics())
    async def metrics() -> Response:
        for model in {w.model for w in await gateway.live_workers()}:
            gateway.metrics.workers.labels(model=model).set(
                sum(1 for w in gateway._workers[1] if w.model == model)
            )
            await gateway.measure_depth(model)
        return Response(generate_latest(gateway.metrics.registry), media_type="text/plain; version=0.0.4")

    return app


async def _forget(gateway: Gateway, tenant: Tenant, user: str | None, session_id: str | None) -> Response:
    """A deletion within the tenant's limits, answered by the live workers; kept in Redis for those that are not
    (202 while any is pending, or when no worker is live)."""
    try:
        user, session_id = session_label(user, session_id)
        request_id, headers = await gateway.admit_deletion(tenant)
    except (ApiError, Refusal) as error:
        return error_response(error)
    try:
        blocks, workers, pending = await gateway.forget_sessions(tenant.name, user, session_id)
    except ApiError as error:
        return error_response(error)
    finally:
        await gateway.admission.release(tenant, request_id)
    if blocks is None and pending == 0 and workers > 0:
        response = error_response(session_not_found(user, session_id))
        response.headers.update(headers)
        return response
    accepted = pending > 0 or workers == 0
    body: dict[str, Any] = {
        "user": user,
        "blocks": blocks or 0,
        "workers": workers,
        "workers_pending": pending,
    }
    if session_id is None:
        return JSONResponse(
            {"object": "sessions.deleted", **body}, status_code=202 if accepted else 200, headers=headers
        )
    return JSONResponse(
        {"object": "session.deleted", "id": session_id, **body},
        status_code=202 if accepted else 200,
        headers=headers,
    )


@dataclass
class _Answer:
    """One request on its way through the gateway: what its answer is counted and stamped with, and its timing,
    measured here, for the controller's ledger."""

    request: P.FleetRequest
    tenant: Tenant
    caller: Caller
    control: ControlLoop
    arrived: float = field(default_factory=time.monotonic)
    first: float | None = None

    def saw(self, chunk: P.Chunk) -> None:
        if chunk.kind in ("delta", "done") and chunk.ids and self.first is None:
            self.first = time.monotonic()

    def done(self, usage: dict[str, Any] | None) -> None:
        """The answer ended well: its TTFT and TPOT go on the ledger against its tier's promise."""
        tokens = int((usage or {}).get("completion_tokens") or 0)
        if self.first is None:
            self.control.finished(self.caller, None, None)
            return
        tpot = (time.monotonic() - self.first) / (tokens - 1) if tokens > 1 else None
        self.control.finished(self.caller, self.first - self.arrived, tpot)


async def _respond(gateway: Gateway, request: Request, chat: bool) -> Response:
    """Queue one completion and answer it: SSE when `stream`, else one JSON body."""
    tenant: Tenant = request.state.tenant
    metrics = gateway.metrics
    try:
        body = parse_json(await request.body())
        fleet_request, parsed, caller, headers = await gateway.submit(body, chat, tenant)
    except (ApiError, Refusal) as refused:
        error = http_error(refused)
        metrics.outcome(error.status, None, tenant)
        return error_response(error)
    except Exception as exc:
        if not _redis_failure(exc):  # a bug: the app's handler answers 500, never "Redis unreachable"
            metrics.outcome(500, None, tenant)
            raise
        metrics.redis_errors.inc()
        metrics.outcome(503, None, tenant)
        _log.warning("fleet gateway: cannot queue a request: %r", exc)
        return error_response(
            ApiError(503, "the fleet's queue (Redis) is unreachable; retry", kind="unavailable")
        )
    answer = _Answer(fleet_request, tenant, caller, gateway.control.loop_for(fleet_request.model, []))
    stream = gateway.chunks(fleet_request, tenant)
    first = await anext(stream)
    gateway.control.queued(fleet_request.variant, caller.tier, -1)
    if first.kind == "error":
        await stream.aclose()
        metrics.outcome(first.status, caller, tenant)
        if first.status == 429:  # the tenant's tokens, reserved by the worker
            limit = str((first.error or {}).get("type") or "tokens")
            metrics.tenants.rate_limited.labels(caller.tenant, caller.tier, limit).inc()
        return _chunk_error(first, headers)
    metrics.usage.queue.labels(caller.tenant, caller.tier).observe(time.monotonic() - answer.arrived)
    created = int(time.time())
    headers = {**headers, **(first.headers or {}), "x-qpack-worker": first.worker}
    if parsed.stream:
        return StreamingResponse(
            _events(
                gateway,
                answer,
                stream,
                render.Chunks(
                    fleet_request.request_id,
                    chat,
                    created,
                    fleet_request.model,
                    caller.service_tier,
                    gateway.fingerprint(first.worker),
                ),
                parsed.include_usage,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **headers},
        )
    response = await _whole(
        gateway, request, answer, stream, chat, created, gateway.fingerprint(first.worker)
    )
    response.headers.update(headers)
    return response


def _redis_failure(error: BaseException) -> bool:
    """Whether `error` is Redis that could not be asked (down, unreachable, too slow): a 503 the client retries."""
    from redis.exceptions import RedisError

    return isinstance(error, (RedisError, OSError, TimeoutError))


def _count_usage(gateway: Gateway, caller: Caller, usage: dict[str, Any] | None) -> None:
    for kind in ("prompt", "completion"):
        tokens = (usage or {}).get(f"{kind}_tokens")
        if isinstance(tokens, int):
            gateway.metrics.usage.tokens.labels(caller.tenant, caller.tier, kind).inc(tokens)


def _models(workers: list[P.WorkerInfo]) -> dict[str, Any]:
    """`/v1/models`: each model live workers announce, with its version, content hash, worker count, the prefill
    precisions its workers run, and its variants (variants) with their measured KL, most accurate first."""
    by_model: dict[str, list[P.WorkerInfo]] = {}
    for worker in workers:
        by_model.setdefault(worker.model, []).append(worker)
    data = []
    for model, mine in sorted(by_model.items()):
        by_variant: dict[str, list[P.WorkerInfo]] = {}
        for worker in sorted(mine, key=lambda w: w.kl):
            by_variant.setdefault(worker.variant_name, []).append(worker)
        variants = [
            {"id": name, "kl": ws[0].kl, "workers": len(ws), "system_fingerprint": ws[0].fingerprint}
            for name, ws in by_variant.items()
        ]
        data.append(
            {
                "id": model,
                "object": "model",
                "owned_by": "qpack",
                "version": mine[0].version,
                "content_hash": mine[0].content_hash,
                "workers": len(mine),
                "prefill_dtypes": sorted({w.prefill_dtype for w in mine}),
                "variants": variants,
            }
        )
    return {"object": "list", "data": data}


async def _whole(
    gateway: Gateway,
    request: Request,
    answer: _Answer,
    stream: AsyncIterator[P.Chunk],
    chat: bool,
    created: int,
    fingerprint: str | None,
) -> Response:
    """A non-streaming answer; a client that goes away cancels the request on its worker."""
    fleet_request, caller = answer.request, answer.caller
    text: list[str] = []
    reader = asyncio.ensure_future(_collect(stream, text, answer))
    gone = asyncio.ensure_future(disconnected(request))
    await asyncio.wait({reader, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not reader.done():
        reader.cancel()
        await gateway.cancel(fleet_request)
        gateway.metrics.outcome(499, caller, answer.tenant)
        return error_response(ApiError(499, "client disconnected"))
    gone.cancel()
    final = reader.result()
    if final.kind == "error":
        gateway.metrics.outcome(final.status, caller, answer.tenant)
        return _chunk_error(final)
    gateway.metrics.outcome(200, caller, answer.tenant)
    _count_usage(gateway, caller, final.usage)
    answer.done(final.usage)
    usage = final.usage or {}
    choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason}
    joined = "".join(text)
    choice.update(
        {"message": {"role": "assistant", "content": joined}} if chat else {"text": joined, "logprobs": None}
    )
    return JSONResponse(
        {
            "id": fleet_request.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": fleet_request.model,
            "service_tier": caller.service_tier,
            "system_fingerprint": fingerprint,
            "choices": [choice],
            "usage": usage,
        }
    )


def _chunk_error(chunk: P.Chunk, headers: dict[str, str] | None = None) -> Response:
    """A worker's error as the client gets it (its rate-limit headers, over the gateway's own)."""
    error = chunk.error or {}
    status = chunk.status or 500
    return error_response(
        ApiError(
            status,
            str(error.get("message") or "request failed"),
            error.get("param"),
            error.get("code"),
            str(error.get("type") or "server_error"),
            headers={**(headers or {}), **(chunk.headers or {})},
        )
    )


async def _collect(stream: AsyncIterator[P.Chunk], text: list[str], answer: _Answer) -> P.Chunk:
    async for chunk in stream:
        answer.saw(chunk)
        if chunk.kind == "delta":
            text.append(chunk.text)
        elif chunk.kind in ("done", "error"):
            if chunk.kind == "done":
                text.append(chunk.text)
            return chunk
    return P.Chunk("error", status=500, error={"message": "the answer ended early", "type": "server_error"})


def _events(
    gateway: Gateway,
    answer: _Answer,
    stream: AsyncGenerator[P.Chunk, None],
    chunks: render.Chunks,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE stream of a fleet answer; each outcome counted once, a client that goes away cancels the request
    on its worker."""
    metrics, caller = gateway.metrics, answer.caller

    async def pieces() -> AsyncIterator[Piece]:
        async for chunk in stream:
            answer.saw(chunk)
            if chunk.kind == "delta":
                yield Piece(chunk.text)
            elif chunk.kind == "done":
                metrics.outcome(200, caller, answer.tenant)
                _count_usage(gateway, caller, chunk.usage)
                answer.done(chunk.usage)
                yield Piece(chunk.text, True, chunk.finish_reason, chunk.usage)
                return
            elif chunk.kind == "error":
                metrics.outcome(chunk.status, caller, answer.tenant)
                yield Piece(None, True, "error")
                return

    async def abandon() -> None:
        await gateway.cancel(answer.request)
        await stream.aclose()

    return sse_events(pieces(), chunks, include_usage, abandon)
