"""The HTTP routes in front of the engine: thin handlers over `protocol` (parsing), `prompts` (tokenizing) and
`render` (response bodies), behind a guard that treats every request as hostile.

- `Guard` (plain ASGI, in front of everything under /v1): the API key names the tenant (`serve.tenancy`: sha256
  digests compared in constant time, every configured key compared, none logged), which the request carries from
  then on (`request.state.tenant`); 503 while draining, and bodies over `max_request_bytes` refused with 413
  before anything is parsed (Content-Length, or counted as a chunked body arrives).
- Per request, its tenant's limits (`serve.tenancy.admission.Door`): a concurrency slot and a request before the
  prompt is tokenized, prompt + max_tokens from the token bucket after, the unused part back at the end; a
  refusal is OpenAI's 429 with `Retry-After` and `x-ratelimit-*` headers, which successful answers carry too.
  `service_tier` may lower the tier a request runs at, never raise it; the answer says which it ran at.
  `user`, `session_id` and the session deletions are names inside the caller's tenant.
- Tokenizing runs on one worker thread, never on the event loop, after a character cap (`prompts`), so a huge
  prompt can neither stall `/health` nor other requests' streams.
- A client that disconnects aborts its request at once, streaming or not: a watcher task waits for the ASGI
  `http.disconnect` beside the engine's outputs, so its KV blocks are freed within one engine step.
- Nothing a client sends produces a non-JSON 500: a catch-all answers any bug with an OpenAI-shaped 500.

Handlers run on the asyncio loop; the engine steps on its own thread and hands each request its new text through
a thread-safe callback into the request's asyncio queue. A full queue is a 429 with Retry-After. While the
server drains (SIGTERM), new requests get 503 and running ones finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.engine import Engine, RequestOutput
from serve.openai import render
from serve.openai.answers import Piece, disconnected, engine_refusals, sse_events
from serve.openai.prompts import check_text_size, longest_token_chars, prompt_ids, shared_tokens
from serve.openai.protocol import (
    ApiError,
    GenerationRequest,
    check_model,
    parse_json,
    parse_request,
    session_label,
)
from serve.options import DEFAULT_MAX_REQUEST_BYTES
from serve.request import SamplingParams
from serve.tenancy.admission import Door, Ticket, limited_params, owner_of
from serve.tenancy.limits import LocalLimiter
from serve.tenancy.tenants import Caller, Tenant, TenantsSource

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


def error_response(error: ApiError) -> JSONResponse:
    """The OpenAI error body; a 429 or 503 without headers of its own says Retry-After: 1."""
    headers = dict(error.headers)
    if error.status in (429, 503) and not headers:
        headers["Retry-After"] = "1"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than {limit:,} bytes (--max-request-bytes); send a shorter prompt",
            code="request_too_large",
        )


class Guard:
    """ASGI middleware for /v1: the caller's tenant from its API key, draining, body size. Reads no body itself."""

    def __init__(self, app: Any, info: ServerInfo, draining: Callable[[], bool]) -> None:
        self.app, self.info, self.draining = app, info, draining

    def tenant(self, header: bytes | None) -> Tenant | None:
        """The tenant of the `Authorization: Bearer KEY` header (any tenant when the server has no keys)."""
        presented = header[7:] if header is not None and header.startswith(b"Bearer ") else None
        return self.info.tenants.current.authenticate(presented)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            if int(length) > self.info.max_request_bytes:
                return BodyTooLarge(self.info.max_request_bytes)
        return None


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


class Generation:
    """Submits validated requests to the engine, within their tenant's limits, and turns the engine's outputs into
    responses or SSE streams."""

    def __init__(self, engine: Engine, info: ServerInfo) -> None:
        self.engine, self.info = engine, info
        self.max_chars = engine.max_model_len * longest_token_chars(engine.tokenizer)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qpack-tokenize")
        self.door = Door(LocalLimiter(), engine.metrics.tenants, hold=(info.request_timeout or 3600.0) + 60)

    async def respond(self, request: Request, chat: bool) -> Response:
        tenant: Tenant = request.state.tenant
        tier = tenant.tier.name
        ticket: Ticket | None = None
        try:
            parsed = self._parse(parse_json(await request.body()), chat)
            caller = self.info.tenants.current.caller(tenant, parsed.service_tier)
            tier = caller.tier
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            ticket = self.door.admit(tenant, caller, request_id)
            ids, params, shared = await self._prompt(parsed, caller)
            self.door.reserve(ticket, len(ids), params.max_tokens)
            queue = self._submit(request_id, ids, params, parsed, caller, shared)
        except ApiError as error:
            if ticket is not None:
                self.door.close(ticket, 0, ran=False)
            return self._counted(error_response(error), tenant.name, tier)
        created = int(time.time())
        if parsed.stream:
            chunks = render.Chunks(request_id, chat, created, self.info.name, caller.service_tier)
            return self._counted(
                StreamingResponse(
                    self._events(ticket, queue, chunks, parsed.include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", **ticket.headers},
                ),
                tenant.name,
                tier,
            )
        completion = 0
        try:
            text, final = await self._collect(request, request_id, queue)
            completion = final.completion_tokens
        except ApiError as error:
            return self._counted(error_response(error), tenant.name, tier)
        finally:
            self.door.close(ticket, completion)
        answer = self._final(request_id, chat, created, text, final, caller)
        answer.headers.update(ticket.headers)
        return self._counted(answer, tenant.name, tier)

    def _final(
        self, request_id: str, chat: bool, created: int, text: str, final: RequestOutput, caller: Caller
    ) -> Response:
        if final.finish_reason == "timeout":
            return error_response(
                ApiError(504, f"request timed out after {self.info.request_timeout} s", kind="timeout")
            )
        if final.finish_reason == "error":
            failed = ApiError(
                500, "the model step failed; see the server log", kind="server_error", code="engine_error"
            )
            return error_response(failed)
        body = render.response(request_id, chat, created, self.info.name, text, final, caller.service_tier)
        return JSONResponse(body)

    def _counted(self, response: Response, tenant: str, tier: str) -> Response:
        self.engine.metrics.tenants.requests.labels(tenant, tier, str(response.status_code)).inc()
        return response

    def _parse(self, body: dict[str, Any], chat: bool) -> GenerationRequest:
        check_model(body, self.info.name, self.info.version)
        parsed = parse_request(body, chat)
        check_text_size(parsed, self.max_chars, self.engine.max_model_len)
        return parsed

    async def _prompt(
        self, parsed: GenerationRequest, caller: Caller
    ) -> tuple[list[int], SamplingParams, tuple[str, int] | None]:
        """Token ids (on the tokenizer thread), sampling parameters within the caller's limits, and the shared
        prefix the prompt starts with, if its tenant shares one."""
        loop = asyncio.get_running_loop()
        engine = self.engine

        def tokenize() -> tuple[list[int], tuple[str, int] | None]:
            ids = prompt_ids(parsed, engine.tokenizer, engine.vocab_size)
            return ids, shared_tokens(parsed, ids, caller.shared_prefixes, engine.tokenizer)

        ids, shared = await loop.run_in_executor(self.tokenizing, tokenize)
        return ids, limited_params(parsed, len(ids), engine.max_model_len, caller), shared

    def _submit(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        parsed: GenerationRequest,
        caller: Caller,
        shared: tuple[str, int] | None,
    ) -> asyncio.Queue[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def callback(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, output)

        with engine_refusals("server"):
            self.engine.add(
                request_id,
                ids,
                params,
                callback,
                priority=parsed.priority,
                timeout=self.info.request_timeout,
                cache_salt=(parsed.cache_salt or "").encode(),
                owner=owner_of(caller, parsed),
                shared=shared,
            )
        return queue

    async def _collect(
        self, request: Request, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> tuple[str, RequestOutput]:
        """The whole answer; the request is aborted the moment its client disconnects."""
        text = []
        gone = asyncio.ensure_future(disconnected(request))
        try:
            while True:
                output = asyncio.ensure_future(queue.get())
                await asyncio.wait({output, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not output.done():
                    output.cancel()
                    self.engine.abort(request_id)
                    raise ApiError(499, "client disconnected")
                text.append(output.result().text)
                if output.result().finished:
                    return "".join(text), output.result()
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise
        finally:
            gone.cancel()

    def _events(
        self, ticket: Ticket, queue: asyncio.Queue[RequestOutput], chunks: render.Chunks, include_usage: bool
    ) -> AsyncIterator[str]:
        completion = 0

        async def pieces() -> AsyncIterator[Piece]:
            nonlocal completion
            while True:
                output = await queue.get()
                completion = output.completion_tokens
                if not output.finished:
                    yield Piece(output.text)
                    continue
                yield Piece(output.text, True, output.finish_reason, render.usage(output))
                return

        async def abandon() -> None:
            self.engine.abort(ticket.request_id)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in sse_events(pieces(), chunks, include_usage, abandon):
                    yield event
            finally:
                self.door.close(ticket, completion)

        return events()


def create_app(engine: Engine, info: ServerInfo) -> FastAPI:
    stop_event = threading.Event()
    state: dict[str, Any] = {"draining": False, "thread": None}
    generation = Generation(engine, info)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=engine.run, args=(stop_event,), name="qpack-engine", daemon=True)
        thread.start()
        state["thread"] = thread
        try:
            yield
        finally:
            state["draining"] = True
            while engine.has_work():
                await asyncio.sleep(0.05)
            stop_event.set()
            engine.wake()
            thread.join(timeout=10)
            generation.tokenizing.shutdown(wait=False)
            engine.close()

    app = FastAPI(title="qpack serve", lifespan=lifespan)
    app.state.engine = engine
    app.state.info = info
    app.state.server_state = state
    app.state.start_draining = lambda: state.update(draining=True)
    app.add_middleware(Guard, info=info, draining=lambda: bool(state["draining"]))
    app.add_exception_handler(Exception, _internal_error)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation.respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation.respond(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": info.name,
            "object": "model",
            "created": 0,
            "owned_by": "qpack",
            "version": info.version,
        }
        numerics = info.numerics or engine.numerics()
        return {
            "object": "list",
            "data": [{**model, "max_model_len": engine.max_model_len, "numerics": numerics}],
        }

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str, user: str | None = None) -> Response:
        """A privacy request: the session's stored KV leaves every tier (and the pool's prefix cache). Only the
        caller's tenant's sessions are seen: another tenant's session is a 404, like one that never existed."""
        return _forget(engine, request.state.tenant, user, session_id)

    @app.delete("/v1/sessions")
    async def delete_user_sessions(request: Request, user: str | None = None) -> Response:
        return _forget(engine, request.state.tenant, user, None)

    @app.get("/health")
    async def health() -> Response:
        if state["draining"]:
            return JSONResponse({"status": "draining"}, status_code=503)
        running, waiting = len(engine.scheduler.running), engine.scheduler.num_waiting
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _forget(engine: Engine, tenant: Tenant, user: str | None, session_id: str | None) -> Response:
    try:
        user, session_id = session_label(user, session_id)
    except ApiError as error:
        return error_response(error)
    blocks = engine.forget_sessions(tenant.name, user, session_id)
    if blocks is None:
        return error_response(session_not_found(user, session_id))
    if session_id is None:
        return JSONResponse({"object": "sessions.deleted", "user": user, "blocks": blocks})
    return JSONResponse({"object": "session.deleted", "id": session_id, "user": user, "blocks": blocks})


def session_not_found(user: str | None, session_id: str | None) -> ApiError:
    """The 404 of a deletion that found nothing: the same words whether the session never existed or is another
    tenant's."""
    what = (
        "session"
        + (f" {session_id!r}" if session_id is not None else "s")
        + (f" of user {user!r}" if user else "")
    )
    return ApiError(404, f"no stored {what} for this API key", "session_id", "session_not_found")


async def _internal_error(_request: Request, error: Exception) -> Response:
    """A bug, never the client's input: logged with its traceback, answered in the OpenAI error shape."""
    if isinstance(error, ApiError):
        return error_response(error)
    _log.error("request failed", exc_info=error)
    body = ApiError(500, "internal server error; see the server log", kind="server_error").body()
    return Response(json.dumps(body), status_code=500, media_type="application/json")
