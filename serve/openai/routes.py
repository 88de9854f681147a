"""The HTTP routes in front of the engine: thin handlers over `protocol` (parsing), `prompts` (tokenizing) and
`render` (response bodies).

Handlers run on the asyncio loop; the engine steps on its own thread and hands each request its new text
through a thread-safe callback into the request's asyncio queue. A full queue is a 429 with Retry-After; a
missing or wrong API key a 401. A client that disconnects aborts its request, which frees its KV blocks at once.
While the server drains (SIGTERM), new requests get 503 and running ones finish.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.engine import Engine, QueueFull, RequestOutput
from serve.openai import render
from serve.openai.prompts import prompt_ids
from serve.openai.protocol import (
    ApiError,
    GenerationRequest,
    check_model,
    parse_json,
    parse_request,
    sampling_params,
)


@dataclass(frozen=True)
class ServerInfo:
    name: str
    version: str
    api_key: str | None = None
    request_timeout: float | None = 600.0


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class Generation:
    """Submits validated requests to the engine and turns its outputs into responses or SSE streams."""

    def __init__(self, engine: Engine, info: ServerInfo) -> None:
        self.engine, self.info = engine, info

    async def respond(self, request: Request, chat: bool) -> Response:
        try:
            body = parse_json(await request.body())
            check_model(body, self.info.name, self.info.version)
            parsed = parse_request(body, chat)
            vocab = int(self.engine.model.config.vocab_size)  # type: ignore[attr-defined]
            ids = prompt_ids(parsed, self.engine.tokenizer, vocab)
            params = sampling_params(parsed, len(ids), self.engine.max_model_len)
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            queue = self._submit(request_id, ids, params, parsed.priority)
        except ApiError as error:
            return error_response(error)
        created = int(time.time())
        if parsed.stream:
            chunks = render.Chunks(request_id, chat, created, self.info.name)
            return StreamingResponse(
                self._events(request_id, queue, chunks, parsed),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            text, final = await self._collect(request, request_id, queue)
        except ApiError as error:
            return error_response(error)
        if final.finish_reason == "timeout":
            return error_response(
                ApiError(504, f"request timed out after {self.info.request_timeout} s", kind="timeout")
            )
        if final.finish_reason == "error":
            failed = ApiError(
                500, "the model step failed; see the server log", kind="server_error", code="engine_error"
            )
            return error_response(failed)
        return JSONResponse(render.response(request_id, chat, created, self.info.name, text, final))

    def _submit(
        self, request_id: str, ids: list[int], params: Any, priority: int
    ) -> asyncio.Queue[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def callback(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, output)

        try:
            self.engine.add(
                request_id, ids, params, callback, priority=priority, timeout=self.info.request_timeout
            )
        except QueueFull as exc:
            raise ApiError(
                429, f"server busy: {exc}; retry later", code="queue_full", kind="rate_limit_error"
            ) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return queue

    async def _collect(
        self, request: Request, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> tuple[str, RequestOutput]:
        text = []
        try:
            while True:
                try:
                    output = await asyncio.wait_for(queue.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.engine.abort(request_id)
                        raise ApiError(499, "client disconnected") from None
                    continue
                text.append(output.text)
                if output.finished:
                    return "".join(text), output
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise

    async def _events(
        self,
        request_id: str,
        queue: asyncio.Queue[RequestOutput],
        chunks: render.Chunks,
        parsed: GenerationRequest,
    ) -> AsyncIterator[str]:
        finished = False
        try:
            if parsed.chat:
                yield chunks.role()
            while not finished:
                output = await queue.get()
                finished = output.finished
                if output.text or finished:
                    yield chunks.delta(output.text, output.finish_reason if finished else None)
                if finished and parsed.include_usage:
                    yield chunks.usage(output)
            yield render.DONE
        finally:
            if not finished:
                self.engine.abort(request_id)


def create_app(engine: Engine, info: ServerInfo) -> FastAPI:
    stop_event = threading.Event()
    state: dict[str, Any] = {"draining": False, "thread": None}

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

    app = FastAPI(title="qpack serve", lifespan=lifespan)
    app.state.engine = engine
    app.state.info = info
    app.state.server_state = state
    app.state.start_draining = lambda: state.update(draining=True)
    generation = Generation(engine, info)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/v1/"):
            if info.api_key is not None and request.headers.get("authorization") != f"Bearer {info.api_key}":
                missing = "invalid or missing API key (send 'Authorization: Bearer KEY')"
                return error_response(ApiError(401, missing, code="invalid_api_key"))
            if state["draining"] and request.method == "POST":
                draining = "the server is shutting down; retry on another replica"
                return error_response(ApiError(503, draining, kind="server_shutting_down"))
        return await call_next(request)

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
        return {"object": "list", "data": [{**model, "max_model_len": engine.max_model_len}]}

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
