"""A completion request from its body to its last byte, in a single server: the tenant's limits at the door
(`serve.tenancy.admission.Door`), the surge controller's word (`serve.control.loop`: a 429 while the request's
tier is shed, and the variant it runs on), tokenizing on a worker thread, the engine, and the answer, whole or as
server-sent events.

A streaming answer starts (status line and headers) with the engine's first output, not before: a request the
scheduler lets go from its queue for a higher tier's (`shed`) still gets a proper 429 instead of a 200 stream
that fails. Every answer names the variant that computed it (`x-qpack-variant`, `system_fingerprint`), and its
time to first token and per output token go on the controller's ledger against its tier's promise.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.control.loop import ControlLoop
from serve.core.request import SamplingParams
from serve.engine.output import RequestOutput
from serve.metrics import TenantMetrics
from serve.openai import render
from serve.openai.answers import Piece, disconnected, engine_refusals, sse_events
from serve.openai.errors import error_response
from serve.openai.prompts import check_text_size, longest_token_chars, prompt_ids, shared_tokens
from serve.openai.protocol import (
    ApiError,
    GenerationRequest,
    http_error,
    limited_params,
    owner_of,
    parse_json,
    parse_request,
)
from serve.refusal import Refusal
from serve.tenancy.admission import Door, Ticket
from serve.tenancy.limits import LocalLimiter
from serve.tenancy.tenants import Caller, Tenant, TenantsSource
from serve.variants import Served, Variants


@dataclass
class _Timing:
    """When a request arrived and produced its first and last token: its TTFT and TPOT."""

    arrived: float = field(default_factory=time.monotonic)
    first: float | None = None
    tokens: int = 0
    done: bool = False  # it ran to its end (not aborted by its client)

    def saw(self, output: RequestOutput) -> None:
        if output.token_ids and self.first is None:
            self.first = time.monotonic()
        self.tokens = output.completion_tokens
        self.done = output.finished and output.finish_reason != "abort"

    def measured(self) -> tuple[float | None, float | None]:
        if self.first is None:
            return None, None
        tpot = (time.monotonic() - self.first) / (self.tokens - 1) if self.tokens > 1 else None
        return self.first - self.arrived, tpot


@dataclass
class _Call:
    """One request in flight: who, on which variant, its ticket at the door and its output queue."""

    request_id: str
    chat: bool
    parsed: GenerationRequest
    caller: Caller
    served: Served
    ticket: Ticket
    queue: asyncio.Queue[RequestOutput]
    timing: _Timing
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def headers(self) -> dict[str, str]:
        return {**self.ticket.headers, "x-qpack-variant": self.served.name}


class Generation:
    def __init__(
        self,
        variants: Variants,
        tenants: TenantsSource,
        control: ControlLoop,
        metrics: TenantMetrics,
        request_timeout: float | None,
    ) -> None:
        self.variants, self.tenants, self.control, self.metrics = variants, tenants, control, metrics
        self.request_timeout = request_timeout
        primary = variants.primary.engine
        self.max_chars = primary.max_model_len * longest_token_chars(primary.tokenizer)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qpack-tokenize")
        self.door = Door(LocalLimiter(), metrics, hold=(request_timeout or 3600.0) + 60)

    async def respond(self, request: Request, chat: bool) -> Response:
        tenant: Tenant = request.state.tenant
        tier = tenant.tier.name
        try:
            call = await self._start(request, chat, tenant)
        except _Refused as refused:
            return self._counted(error_response(refused.error), tenant.name, refused.tier or tier)
        tier = call.caller.tier
        try:
            first = await self._next(request, call)
        except ApiError as error:
            self._close(call, ran=True)
            return self._counted(error_response(error), tenant.name, tier)
        if first.finished and first.finish_reason == "shed":
            self._close(call, ran=False)
            self.control.shed(call.caller)
            overloaded = ApiError(
                429,
                "the server is over capacity; higher tiers are served first: retry later",
                code="overloaded",
            )
            return self._counted(error_response(overloaded), tenant.name, tier)
        if call.parsed.stream:
            return self._counted(self._stream(call, first), tenant.name, tier)
        try:
            text, final = await self._collect(request, call, first)
        except ApiError as error:
            return self._counted(error_response(error), tenant.name, tier)
        finally:
            self._close(call, ran=True)
        answer = self._final(call, text, final)
        answer.headers.update(call.headers)
        return self._counted(answer, tenant.name, tier)

    # ------------------------------------------------------------------ before the engine

    async def _start(self, request: Request, chat: bool, tenant: Tenant) -> _Call:
        """Parse, resolve the caller, take a ticket (the tenant's limits), ask the controller, tokenize, reserve
        and submit; _Refused carries the answer when any of it says no. Only a request its tenant's limits let in
        is an arrival for the controller: a tenant's own 429s never raise its tier's forecast."""
        ticket: Ticket | None = None
        caller: Caller | None = None
        try:
            body = parse_json(await request.body())
            parsed = parse_request(body, chat)
            pinned = self.variants.pinned(body.get("model"))
            check_text_size(parsed, self.max_chars, self.variants.primary.engine.max_model_len)
            caller = self.tenants.current.caller(tenant, parsed.service_tier)
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            ticket = self.door.admit(tenant, caller, request_id)
            self.control.arrived(caller)
            refusal = self.control.refusal(caller)
            if refusal is not None:
                raise refusal
            served = self.variants[self.control.variant_for(caller, pinned).variant]
            ids, params, shared = await self._prompt(parsed, caller, served)
            self.door.reserve(ticket, len(ids), params.max_tokens)
            call = _Call(request_id, chat, parsed, caller, served, ticket, asyncio.Queue(), _Timing())
            self._submit(call, ids, params, shared)
        except (ApiError, Refusal) as error:
            if ticket is not None:
                self.door.close(ticket, 0, ran=False)
            raise _Refused(http_error(error), caller.tier if caller is not None else None) from None
        return call

    async def _prompt(
        self, parsed: GenerationRequest, caller: Caller, served: Served
    ) -> tuple[list[int], SamplingParams, tuple[str, int] | None]:
        """Token ids (on the tokenizer thread), sampling parameters within the caller's limits, and the shared
        prefix the prompt starts with, if its tenant shares one."""
        loop = asyncio.get_running_loop()
        engine = served.engine

        def tokenize() -> tuple[list[int], tuple[str, int] | None]:
            ids = prompt_ids(parsed, engine.tokenizer, engine.vocab_size)
            return ids, shared_tokens(parsed, ids, caller.shared_prefixes, engine.tokenizer)

        ids, shared = await loop.run_in_executor(self.tokenizing, tokenize)
        return ids, limited_params(parsed, len(ids), engine.max_model_len, caller), shared

    def _submit(
        self, call: _Call, ids: list[int], params: SamplingParams, shared: tuple[str, int] | None
    ) -> None:
        loop = asyncio.get_running_loop()

        def callback(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(call.queue.put_nowait, output)

        with engine_refusals("server"):
            call.served.engine.add(
                call.request_id,
                ids,
                params,
                callback,
                priority=call.parsed.priority,
                timeout=self.request_timeout,
                cache_salt=(call.parsed.cache_salt or "").encode(),
                owner=owner_of(call.caller, call.parsed),
                shared=shared,
            )

    # ------------------------------------------------------------------ the answer

    async def _next(self, request: Request, call: _Call) -> RequestOutput:
        """The engine's next output; the request is aborted the moment its client disconnects."""
        gone = asyncio.ensure_future(disconnected(request))
        output = asyncio.ensure_future(call.queue.get())
        try:
            await asyncio.wait({output, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.served.engine.abort(call.request_id)
            raise
        finally:
            gone.cancel()
        if not output.done():
            output.cancel()
            call.served.engine.abort(call.request_id)
            raise ApiError(499, "client disconnected")
        call.timing.saw(output.result())
        return output.result()

    async def _collect(
        self, request: Request, call: _Call, first: RequestOutput
    ) -> tuple[str, RequestOutput]:
        text, output = [first.text], first
        while not output.finished:
            output = await self._next(request, call)
            text.append(output.text)
        return "".join(text), output

    def _final(self, call: _Call, text: str, final: RequestOutput) -> Response:
        if final.finish_reason == "timeout":
            return error_response(
                ApiError(504, f"request timed out after {self.request_timeout} s", kind="timeout")
            )
        if final.finish_reason == "error":
            failed = ApiError(
                500,
                "generating this request failed; see the server log",
                kind="server_error",
                code="engine_error",
            )
            return error_response(failed)
        body = render.response(
            call.request_id,
            call.chat,
            call.created,
            self.variants.model,
            text,
            final,
            call.caller.service_tier,
            call.served.fingerprint,
        )
        return JSONResponse(body)

    def _stream(self, call: _Call, first: RequestOutput) -> StreamingResponse:
        chunks = render.Chunks(
            call.request_id,
            call.chat,
            call.created,
            self.variants.model,
            call.caller.service_tier,
            call.served.fingerprint,
        )

        async def pieces() -> AsyncIterator[Piece]:
            output = first
            while True:
                if not output.finished:
                    yield Piece(output.text)
                else:
                    yield Piece(output.text, True, output.finish_reason, render.usage(output))
                    return
                output = await call.queue.get()
                call.timing.saw(output)

        async def abandon() -> None:
            call.served.engine.abort(call.request_id)

        async def events() -> AsyncIterator[str]:
            try:
                async for event in sse_events(pieces(), chunks, call.parsed.include_usage, abandon):
                    yield event
            finally:
                self._close(call, ran=True)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **call.headers}
        )

    def _close(self, call: _Call, ran: bool) -> None:
        """The request is over: its ticket back at the door, and when it ran to its end (a timeout or an error
        included, a client that left not) its timing on the controller's ledger."""
        if call.ticket.closed:
            return
        self.door.close(call.ticket, call.timing.tokens, ran=ran)
        if ran and call.timing.done:
            ttft, tpot = call.timing.measured()
            self.control.finished(call.caller, ttft, tpot)

    def _counted(self, response: Response, tenant: str, tier: str) -> Response:
        self.metrics.requests.labels(tenant, tier, str(response.status_code)).inc()
        return response

    def shutdown(self) -> None:
        self.tokenizing.shutdown(wait=False)


class _Refused(Exception):
    def __init__(self, error: ApiError, tier: str | None) -> None:
        super().__init__(error.message)
        self.error, self.tier = error, tier
