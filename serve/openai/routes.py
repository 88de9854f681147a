"""The HTTP routes in front of the engine: thin handlers over `protocol` (parsing), `prompts` (tokenizing) and
`render` (response bodies), behind a guard that treats every request as hostile. What runs around them (the
engine and controller threads, the drain, building the controller) is `serve.server`'s.

- `Guard` (plain ASGI, in front of everything under /v1): the API key names the tenant (`serve.tenancy`: sha256
  digests compared in constant time, every configured key compared, none logged), which the request carries from
  then on (`request.state.tenant`); 503 while draining, and bodies over `max_request_bytes` refused with 413
  before anything is parsed (Content-Length, or counted as a chunked body arrives).
- Per request, its tenant's limits (`serve.tenancy.admission.Door`): a concurrency slot and a request before the
  prompt is tokenized, prompt + max_tokens from the token bucket after, the unused part back at the end; a
  refusal is OpenAI's 429 with `Retry-After` and `x-ratelimit-*` headers, which successful answers carry too.
  `service_tier` may lower the tier a request runs at, never raise it; the answer says which it ran at.
  `user`, `session_id` and the session deletions are names inside the caller's tenant. A deletion takes a
  request and a slot at the door too, and runs on its own thread (`Sessions`): it may wait for an engine step to
  unregister the blocks from the prefix cache, and nothing on the event loop may.
- Requests themselves are `serve.openai.generation`'s: tokenizing on one worker thread, never on the event loop,
  after a character cap (`prompts`), so a huge prompt can neither stall `/health` nor other requests' streams;
  the surge controller's refusals and routes (`serve.control`); the variant that answers.
- A client that disconnects aborts its request at once, streaming or not: a watcher task waits for the ASGI
  `http.disconnect` beside the engine's outputs, so its KV blocks are freed within one engine step.
- Nothing a client sends produces a non-JSON 500: a catch-all answers any bug with an OpenAI-shaped 500.
- Exposure: `/metrics` names tenants, so a server with a tenants file on a non-loopback address refuses to start
  without a metrics key (`ServeOptions.validate`). `/docs`, `/redoc` and `/openapi.json` are off (404) on a
  non-loopback address whenever the server has API keys (`docs_served`): they would show an unauthenticated
  caller the whole surface, and a browser cannot send the metrics key to read them. On loopback, or on a server
  without keys (which anyone reaching it may use anyway), they stay on. The fleet gateway follows the same rule;
  a fleet worker's own app (/health, /metrics) serves no docs.

Handlers run on the asyncio loop; the engine steps on its own thread and hands each request its new text through
a thread-safe callback into the request's asyncio queue. A full queue is a 429 with Retry-After. While the
server drains (SIGTERM), new requests get 503 and running ones finish.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from serve.control.controller import ControlConfig
from serve.engine.core import Engine
from serve.metrics import Labelled
from serve.metrics import render as render_metrics
from serve.openai import schema
from serve.openai.errors import error_response, session_not_found
from serve.openai.generation import Generation
from serve.openai.protocol import ApiError, session_label
from serve.options import DEFAULT_MAX_REQUEST_BYTES, LOOPBACK
from serve.refusal import Refusal
from serve.tenancy.admission import Door
from serve.tenancy.tenants import Tenant, TenantsSource, key_digest
from serve.variants import Variants

_log = logging.getLogger("qpack.serve")


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ServerInfo:
    name: str
    version: str
    tenants: TenantsSource = field(default_factory=TenantsSource)  # who may ask (keys -> tenants), reloadable
    request_timeout: float | None = 600.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    numerics: dict[str, Any] = field(default_factory=dict)  # how the model computes (`Engine.numerics`)
    control: ControlConfig | None = None  # the surge controller's settings (None: the static configuration)
    metrics_key: str | None = None  # the bearer key /metrics asks for (None: open)
    docs: bool = True  # serve /docs, /redoc and /openapi.json (`docs_served`)


NO_DOCS: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None}


def docs_served(host: str, keyed: bool) -> bool:
    """Whether /docs, /redoc and /openapi.json are served: on a loopback bind, or by a server without API keys
    (open to whoever reaches it anyway); a keyed server on a public address shows its surface to no one."""
    return host in LOOPBACK or not keyed


def fastapi_app(title: str, info: ServerInfo, **kwargs: Any) -> FastAPI:
    """The FastAPI app of a server, with its docs routes only where `info.docs` allows them."""
    app = FastAPI(title=title, **kwargs, **({} if info.docs else NO_DOCS))
    described = app.openapi

    def openapi() -> dict[str, Any]:
        return schema.add_security(described())

    app.openapi = openapi  # type: ignore[method-assign]
    return app


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than {limit:,} bytes (--max-request-bytes); send a shorter prompt",
            code="request_too_large",
        )


class Guard:
    """ASGI middleware for /v1: the caller's tenant from its API key, draining, body size. Reads no body itself.
    And /metrics: its key, when the server has one."""

    def __init__(self, app: Any, info: ServerInfo, draining: Callable[[], bool]) -> None:
        self.app, self.info, self.draining = app, info, draining

    def tenant(self, header: bytes | None) -> Tenant | None:
        """The tenant of the `Authorization: Bearer KEY` header (any tenant when the server has no keys)."""
        presented = header[7:] if header is not None and header.startswith(b"Bearer ") else None
        return self.info.tenants.current.authenticate(presented)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            error = metrics_refusal(dict(scope["headers"]).get(b"authorization"), self.info.metrics_key)
            if error is not None:
                await _send_error(send, error)
                return
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        tenant = self.tenant(headers.get(b"authorization"))
        error = self._refusal(scope, headers, tenant)
        if error is not None:
            await _send_error(send, error)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, _limited(receive, self.info.max_request_bytes), send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes], tenant: Tenant | None) -> ApiError | None:
        if tenant is None:
            missing = "invalid or missing API key (send 'Authorization: Bearer KEY')"
            return ApiError(401, missing, code="invalid_api_key")
        if self.draining() and scope["method"] == "POST":
            return ApiError(
                503, "the server is shutting down; retry on another replica", kind="server_shutting_down"
            )
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return ApiError(400, "Content-Length must be a number of bytes")
            if len(length) > 18 or int(length) > self.info.max_request_bytes:  # 18 digits: int() stays cheap
                return BodyTooLarge(self.info.max_request_bytes)
        return None


def metrics_refusal(authorization: bytes | None, key: str | None) -> ApiError | None:
    """The 401 for a /metrics request without the server's metrics key (None: it has none, or it matched);
    compared in constant time, as digests, like the API keys."""
    if key is None or hmac.compare_digest(
        key_digest(authorization or b""), key_digest(b"Bearer " + key.encode())
    ):
        return None
    return ApiError(
        401,
        "/metrics needs the server's metrics key (--metrics-key) as 'Authorization: Bearer KEY'",
        code="invalid_api_key",
    )


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises `BodyTooLarge` once more than `limit` body bytes arrived (chunked uploads)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return wrapped


async def _send_error(send: Send, error: ApiError) -> None:
    response = error_response(error)
    await send(
        {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
    )
    await send({"type": "http.response.body", "body": response.body})


def add_routes(
    app: FastAPI,
    variants: Variants,
    info: ServerInfo,
    generation: Generation,
    sessions: Sessions,
    registry: CollectorRegistry,
    draining: Callable[[], bool],
) -> None:
    """The API's routes over the variants of one model: completions and chat (`generation`), the models, the
    session deletions (`sessions`), health (503 while `draining`) and metrics (`registry` and the engines')."""
    engines = [served.engine for served in variants]
    primary = variants.primary.engine
    shape = partial(
        schema.generation,
        vocab_size=primary.vocab_size,
        max_model_len=primary.max_model_len,
        models=variants.model_names,
    )

    @app.post("/v1/completions", openapi_extra=shape(chat=False))
    async def completions(request: Request) -> Response:
        return await generation.respond(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=shape(chat=True))
    async def chat_completions(request: Request) -> Response:
        return await generation.respond(request, chat=True)

    @app.get("/v1/models", openapi_extra=schema.models())
    async def models() -> dict[str, Any]:
        return _models(variants, info)

    @app.delete("/v1/sessions/{session_id}", openapi_extra=schema.sessions(one=True))
    async def delete_session(request: Request) -> Response:
        """A privacy request: the session's stored KV leaves every tier (and the pool's prefix cache) of every
        variant. Only the caller's tenant's sessions are seen: another tenant's session is a 404, like one that
        never existed."""
        user, session_id = request.query_params.get("user"), request.path_params["session_id"]
        return await sessions.forget(request.state.tenant, user, session_id)

    @app.delete("/v1/sessions", openapi_extra=schema.sessions(one=False))
    async def delete_user_sessions(request: Request) -> Response:
        return await sessions.forget(request.state.tenant, request.query_params.get("user"), None)

    @app.get("/health", openapi_extra=schema.health())
    async def health() -> Response:
        if draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        running = sum(len(e.scheduler.running) for e in engines)
        waiting = sum(e.scheduler.num_waiting for e in engines)
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    @app.get("/metrics", openapi_extra=schema.metrics())
    async def metrics() -> Response:
        return Response(_metrics(registry, variants), media_type="text/plain; version=0.0.4")


def _metrics(registry: CollectorRegistry, variants: Variants) -> bytes:
    """The server's own metrics and its engines': one engine's as they are, several labelled by variant."""
    if len(variants) == 1:
        return render_metrics(registry, variants.primary.engine.metrics.registry)
    merged = CollectorRegistry()
    merged.register(Labelled("variant", {s.name: s.engine.metrics.registry for s in variants}))
    return render_metrics(registry, merged)


def _models(variants: Variants, info: ServerInfo) -> dict[str, Any]:
    """`/v1/models`: the model, with its variants (most accurate first); with several, each also by its own name
    (a request naming one pins it)."""
    primary = variants.primary.engine
    listed = [
        {"id": s.name, "version": s.version, "kl": s.kl, "system_fingerprint": s.fingerprint}
        for s in variants
    ]
    model = {
        "id": variants.model,
        "object": "model",
        "created": 0,
        "owned_by": "qpack",
        "version": variants.version,
        "max_model_len": primary.max_model_len,
        "numerics": info.numerics or primary.numerics(),
        "variants": listed,
    }
    pins = [
        {"object": "model", "created": 0, "owned_by": "qpack", "parent": variants.model, **v} for v in listed
    ]
    return {"object": "list", "data": [model, *(pins if len(variants) > 1 else [])]}


class Sessions:
    """The sessions API: a deletion passes its tenant's limits at the door (a request and a concurrency slot, as
    a completion does: a flood of deletions is a 429, never a stalled server), then runs on a thread of its own,
    never on the event loop, and costs only its tenant's sessions."""

    def __init__(self, engines: list[Engine], tenants: TenantsSource, door: Door) -> None:
        self.engines, self.tenants, self.door = engines, tenants, door
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qpack-sessions")

    async def forget(self, tenant: Tenant, user: str | None, session_id: str | None) -> Response:
        try:
            user, session_id = session_label(user, session_id)
            ticket = self.door.admit(
                tenant, self.tenants.current.caller(tenant, None), f"del-{uuid.uuid4().hex}"
            )
        except (ApiError, Refusal) as error:
            return error_response(error)
        try:
            loop = asyncio.get_running_loop()
            blocks = await loop.run_in_executor(self.pool, self._forget, tenant.name, user, session_id)
        finally:
            self.door.close(ticket, 0, ran=False)
        if blocks is None:
            response = error_response(session_not_found(user, session_id))
        elif session_id is None:
            response = JSONResponse({"object": "sessions.deleted", "user": user, "blocks": blocks})
        else:
            response = JSONResponse(
                {"object": "session.deleted", "id": session_id, "user": user, "blocks": blocks}
            )
        response.headers.update(ticket.headers)
        return response

    def _forget(self, tenant: str, user: str | None, session_id: str | None) -> int | None:
        found = [b for e in self.engines if (b := e.forget_sessions(tenant, user, session_id)) is not None]
        return sum(found) if found else None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False)
