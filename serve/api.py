"""The OpenAI-compatible HTTP API in front of the engine.

Handlers run on the asyncio loop; the engine steps on its own thread and hands each request its new text
through a thread-safe callback into the request's asyncio queue. Errors use the OpenAI shape
(`{"error": {"message", "type", "param", "code"}}`): malformed JSON, wrong types, unsupported options that
would change the result (n > 1, logprobs, penalties...), max_tokens out of range and prompts longer than the
context are 400s naming the field; a full queue is a 429 with Retry-After; a missing or wrong API key is a 401.
A client that disconnects aborts its request, which frees its KV blocks at once. While the server drains
(SIGTERM), new requests get 503 and running ones finish.
"""

from __future__ import annotations

import asyncio
import json
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
from serve.sequence import SamplingParams

UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: v not in (None, False),
    "suffix": lambda v: v is not None,
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "response_format": lambda v: v not in (None, {"type": "text"}),
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass(frozen=True)
class ServerInfo:
    name: str
    version: str
    api_key: str | None = None
    request_timeout: float | None = 600.0


def _number(
    body: dict[str, Any], key: str, default: float, low: float, high: float, integer: bool = False
) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if not low <= value <= high:
        raise ApiError(400, f"'{key}' must be between {low} and {high} (got {value})", key)
    return value


def sampling_from(
    body: dict[str, Any], engine: Engine, prompt_len: int, max_key: str = "max_tokens"
) -> SamplingParams:
    for key, bad in UNSUPPORTED.items():
        if key in body and bad(body[key]):
            raise ApiError(400, f"'{key}' is not supported by this server", key, "unsupported_parameter")
    room = engine.max_model_len - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt is {prompt_len} tokens, longer than the model context of {engine.max_model_len}; shorten it",
            "prompt" if max_key == "max_tokens" else "messages",
            "context_length_exceeded",
        )
    raw_max = body.get(max_key, body.get("max_tokens"))
    if raw_max is None:
        max_tokens = min(16 if max_key == "max_tokens" else room, room)
    else:
        if isinstance(raw_max, bool) or not isinstance(raw_max, int):
            raise ApiError(400, f"'{max_key}' must be an integer", max_key)
        if raw_max <= 0:
            raise ApiError(400, f"'{max_key}' must be at least 1 (got {raw_max})", max_key)
        if raw_max > room:
            raise ApiError(
                400,
                f"'{max_key}' {raw_max} is too large: prompt ({prompt_len} tokens) + {max_key} must fit the "
                f"context of {engine.max_model_len} tokens (at most {room})",
                max_key,
                "context_length_exceeded",
            )
        max_tokens = raw_max
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        stops = tuple(s for s in stop if s)
    else:
        raise ApiError(400, "'stop' must be a string or a list of up to 16 strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "'seed' must be an integer", "seed")
    top_k = _number(body, "top_k", 0, -1, 1_000_000, integer=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        top_k=0 if top_k == -1 else top_k,
        seed=seed,
        stop=stops,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _usage(output: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "total_tokens": output.prompt_tokens + output.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }


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

    def start_draining() -> None:
        state["draining"] = True

    app.state.start_draining = start_draining

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if path.startswith("/v1/"):
            if info.api_key is not None and request.headers.get("authorization") != f"Bearer {info.api_key}":
                return ApiError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    code="invalid_api_key",
                ).response()
            if state["draining"] and request.method == "POST":
                return ApiError(
                    503, "the server is shutting down; retry on another replica", kind="server_shutting_down"
                ).response()
        return await call_next(request)

    async def read_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in (info.name, f"{info.name}:{info.version}"):
            raise ApiError(
                404, f"model {model!r} is not served here; use {info.name!r}", "model", "model_not_found"
            )
        return body

    def submit(
        request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int
    ) -> asyncio.Queue[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def callback(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, output)

        try:
            engine.add(
                request_id, prompt_ids, params, callback, priority=priority, timeout=info.request_timeout
            )
        except QueueFull as exc:
            raise ApiError(
                429, f"server busy: {exc}; retry later", code="queue_full", kind="rate_limit_error"
            ) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return queue

    async def collect(
        request: Request, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> tuple[str, RequestOutput]:
        text = []
        try:
            while True:
                try:
                    output = await asyncio.wait_for(queue.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        engine.abort(request_id)
                        raise ApiError(499, "client disconnected") from None
                    continue
                text.append(output.text)
                if output.finished:
                    return "".join(text), output
        except asyncio.CancelledError:
            engine.abort(request_id)
            raise

    def priority_of(body: dict[str, Any]) -> int:
        return int(_number(body, "priority", 0, -1_000_000, 1_000_000, integer=True))

    def prompt_ids_of(body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' must not be empty", "prompt")
            return list(engine.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = int(engine.model.config.vocab_size)  # type: ignore[attr-defined]
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"'prompt' token ids must be in [0, {vocab})", "prompt")
            return list(prompt)
        raise ApiError(
            400,
            "'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
            "prompt",
        )

    def chat_ids_of(body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, f"messages[{index}] must be an object with a 'role'", "messages")
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                )
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{index}].content must be a string", "messages")
            if message["role"] not in ("system", "user", "assistant", "developer"):
                raise ApiError(
                    400, f"messages[{index}].role {message['role']!r} is not supported", "messages"
                )
            clean.append(
                {"role": "system" if message["role"] == "developer" else message["role"], "content": content}
            )
        tokenizer = engine.tokenizer
        if getattr(tokenizer, "chat_template", None):
            try:
                text = tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
            except Exception as exc:
                raise ApiError(400, f"the chat template rejected these messages: {exc}", "messages") from None
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "".join(f"{m['role']}: {m['content']}\n" for m in clean) + "assistant:"
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])

    async def respond(request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request)
            prompt_ids = chat_ids_of(body) if chat else prompt_ids_of(body)
            params = sampling_from(
                body,
                engine,
                len(prompt_ids),
                "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
            )
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(400, "'stream' must be a boolean", "stream")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise ApiError(400, "'stream_options' must be an object", "stream_options")
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            queue = submit(request_id, prompt_ids, params, priority_of(body))
        except ApiError as error:
            headers = {"Retry-After": "1"} if error.status == 429 else None
            return error.response(headers)
        created = int(time.time())
        if stream:
            return StreamingResponse(
                sse(request_id, queue, chat, created, bool(options.get("include_usage"))),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            text, final = await collect(request, request_id, queue)
        except ApiError as error:
            return error.response()
        if final.finish_reason == "timeout":
            return ApiError(
                504, f"request timed out after {info.request_timeout} s", kind="timeout"
            ).response()
        if final.finish_reason == "error":
            return ApiError(
                500, "the model step failed; see the server log", kind="server_error", code="engine_error"
            ).response()
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": final.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": final.finish_reason, "logprobs": None}
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": info.name,
                "choices": [choice],
                "usage": _usage(final),
            }
        )

    async def sse(
        request_id: str, queue: asyncio.Queue[RequestOutput], chat: bool, created: int, include_usage: bool
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                payload: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta:
                    payload["content"] = delta
                choice: dict[str, Any] = {"index": 0, "delta": payload, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            body = {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": info.name,
                "choices": [choice],
            }
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                output = await queue.get()
                if output.text or output.finished:
                    yield chunk(output.text, output.finish_reason if output.finished else None)
                if output.finished:
                    finished = True
                    if include_usage:
                        body = {
                            "id": request_id,
                            "object": kind,
                            "created": created,
                            "model": info.name,
                            "choices": [],
                            "usage": _usage(output),
                        }
                        yield f"data: {json.dumps(body)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:
                engine.abort(request_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": info.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "qpack",
                    "version": info.version,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if state["draining"]:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "running": len(engine.scheduler.running),
                "waiting": engine.scheduler.num_waiting,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
