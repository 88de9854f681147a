"""The HTTP routes in front of the engine: thin handlers over `protocol` (parsing), `prompts` (tokenizing) and
`render` (response bodies), behind a guard that treats every request as hostile.

- `Guard` (plain ASGI, in front of everything under /v1): API keys compared in constant time (sha256 digests
  through `hmac.compare_digest`, every configured key compared, none logged), 503 while draining, and bodies over
  `max_request_bytes` refused with 413 before anything is parsed (Content-Length, or counted as a chunked body
  arrives).
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
import hashlib
import hmac
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
from serve.openai.prompts import check_text_size, longest_token_chars, prompt_ids
from serve.openai.protocol import (
    ApiError,
    GenerationRequest,
    check_model,
    parse_json,
    parse_request,
    sampling_params,
)
from serve.options import DEFAULT_MAX_REQUEST_BYTES
from serve.request import SamplingParams

_log = logging.getLogger("qpack.serve")


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ServerInfo:
    name: str
    version: str
    api_keys: tuple[str, ...] = ()
    request_timeout: float | None = 600.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    numerics: dict[str, Any] = field(default_factory=dict)  # how the model computes (`Engine.numerics`)

    def __repr__(self) -> str:  # never print a key
        return f"ServerInfo(name={self.name!r}, version={self.version!r}, api_keys=<{len(self.api_keys)}>)"


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than {limit:,} bytes (--max-request-bytes); send a shorter prompt",
            code="request_too_large",
        )


class Guard:
    """ASGI middleware for /v1: API keys, draining, body size. Reads no body itself."""

    def __init__(self, app: Any, info: ServerInfo, draining: Callable[[], bool]) -> None:
        self.app, self.info, self.draining = app, info, draining
        self.key_digests = [hashlib.sha256(key.encode()).digest() for key in info.api_keys]

    def authorized(self, header: bytes | None) -> bool:
        """Constant-time in the key's content: every configured key is compared, equal-length digests."""
        presented = header[7:] if header is not None and header.startswith(b"Bearer ") else b""
        digest = hashlib.sha256(presented).digest()
        matched = False
        for key in self.key_digests:
            matched |= hmac.compare_digest(digest, key)
        return matched and bool(presented)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error = self._refusal(scope, headers)
        if error is not None:
            await _send_error(send, error)
            return
        await self.app(scope, _limited(receive, self.info.max_request_bytes), send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> ApiError | None:
        if self.key_digests and not self.authorized(headers.get(b"authorization")):
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
    """Submits validated requests to the engine and turns its outputs into responses or SSE streams."""

    def __init__(self, engine: Engine, info: ServerInfo) -> None:
        self.engine, self.info = engine, info
        self.max_chars = engine.max_model_len * longest_token_chars(engine.tokenizer)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qpack-tokenize")

    async def respond(self, request: Request, chat: bool) -> Response:
        try:
            parsed, ids, params = await self._read(request, chat)
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            queue = self._submit(request_id, ids, params, parsed)
        except ApiError as error:
            return error_response(error)
        created = int(time.time())
        if parsed.stream:
            chunks = render.Chunks(request_id, chat, created, self.info.name)
            return StreamingResponse(
                self._events(request_id, queue, chunks, parsed.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            text, final = await self._collect(request, request_id, queue)
        except ApiError as error:
            return error_response(error)
        if final.finish_reason == "timeout":
            timeout = ApiError(504, f"request timed out after {self.info.request_timeout} s", kind="timeout")
            return error_response(timeout)
        if final.finish_reason == "error":
            failed = ApiError(
                500, "the model step failed; see the server log", kind="server_error", code="engine_error"
            )
            return error_response(failed)
        return JSONResponse(render.response(request_id, chat, created, self.info.name, text, final))

    async def _read(
        self, request: Request, chat: bool
    ) -> tuple[GenerationRequest, list[int], SamplingParams]:
        """Body -> validated request -> token ids (on the tokenizer thread) -> sampling parameters."""
        body = parse_json(await request.body())
        check_model(body, self.info.name, self.info.version)
        parsed = parse_request(body, chat)
        del body
        check_text_size(parsed, self.max_chars, self.engine.max_model_len)
        loop = asyncio.get_running_loop()
        tokenizer = self.engine.tokenizer
        ids = await loop.run_in_executor(
            self.tokenizing, prompt_ids, parsed, tokenizer, self.engine.vocab_size
        )
        return parsed, ids, sampling_params(parsed, len(ids), self.engine.max_model_len)

    def _submit(
        self, request_id: str, ids: list[int], params: SamplingParams, parsed: GenerationRequest
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
                user=parsed.user,
                session_id=parsed.session_id,
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
        self, request_id: str, queue: asyncio.Queue[RequestOutput], chunks: render.Chunks, include_usage: bool
    ) -> AsyncIterator[str]:
        async def pieces() -> AsyncIterator[Piece]:
            while True:
                output = await queue.get()
                if not output.finished:
                    yield Piece(output.text)
                    continue
                yield Piece(output.text, True, output.finish_reason, render.usage(output))
                return

        async def abandon() -> None:
            self.engine.abort(request_id)

        return sse_events(pieces(), chunks, include_usage, abandon)


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
    async def delete_session(session_id: str, user: str | None = None) -> Response:
        """A privacy request: the session's stored KV leaves every tier (and the pool's prefix cache)."""
        blocks = engine.forget_sessions(user, session_id)
        return JSONResponse({"object": "session.deleted", "id": session_id, "user": user, "blocks": blocks})

    @app.delete("/v1/sessions")
    async def delete_user_sessions(user: str | None = None) -> Response:
        if not user:
            return error_response(ApiError(400, "name the user whose sessions to delete: ?user=NAME", "user"))
        blocks = engine.forget_sessions(user, None)
        return JSONResponse({"object": "sessions.deleted", "user": user, "blocks": blocks})

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


async def _internal_error(_request: Request, error: Exception) -> Response:
    """A bug, never the client's input: logged with its traceback, answered in the OpenAI error shape."""
    if isinstance(error, ApiError):
        return error_response(error)
    _log.error("request failed", exc_info=error)
    body = ApiError(500, "internal server error; see the server log", kind="server_error").body()
    return Response(json.dumps(body), status_code=500, media_type="application/json")
