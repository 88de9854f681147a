"""A fleet worker: one engine that takes its work from Redis streams and streams its answers back.

The worker pulls, never gets pushed: each loop it reads (XREADGROUP) at most as many new entries as its
scheduler has room for, from its own stream (requests of sessions routed to it) and its model's shared stream.
It validates and tokenizes each request exactly as `qpack serve` does (`serve.openai`), on an intake pool of its own
(never on the loop that reads Redis and beats the heart), answers `accepted` (or an `error` with the HTTP status the
gateway should return), and every output of the engine becomes a chunk on the
request's response stream, written by a sender thread so the engine thread never waits on the network. When a
request is answered its entry is XACKed. A heartbeat hash (model, version, content hash, capacity, load) is
refreshed every second with a short TTL; in-flight entries are re-claimed to this worker every few seconds
(which resets their idle time), and entries that a dead worker left pending are claimed once idle for
`claim_idle` seconds and generated again from the start, with the same seed. Session deletions come as
`forget` entries in its own stream (answered), and from the fleet's `forgets` stream, which it reads through at
start and follows while it runs: a deletion sent while it was down is applied before it takes any work.

Identity is the gateway's stamp on each request (`caller`: tenant, tier, limits), never the body: the body's
`user` and `session_id` are names inside that tenant. The worker alone knows a prompt's token count, so it
reserves prompt + max_tokens in the tenant's token bucket in Redis (shared by the fleet) before queuing, and gives
back the unused part in the same round trip that writes the answer's end.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serve.core.request import SamplingParams
from serve.engine import loop
from serve.engine.controls import EngineControls
from serve.engine.core import Engine
from serve.engine.output import RequestOutput
from serve.fleet import wire as P
from serve.openai.answers import engine_refusals
from serve.openai.prompts import check_text_size, longest_token_chars, prompt_ids, shared_tokens
from serve.openai.protocol import (
    ApiError,
    GenerationRequest,
    http_error,
    limited_params,
    owner_of,
    parse_request,
)
from serve.openai.render import usage as _usage
from serve.refusal import Refusal
from serve.tenancy.admission import refusal
from serve.tenancy.redis_limits import LimiterUnavailable, RedisTokens
from serve.tenancy.tenants import Caller

if TYPE_CHECKING:
    from redis.typing import StreamIdT

_log = logging.getLogger("qpack.fleet")


@dataclass
class WorkerConfig:
    redis_url: str
    name: str  # the model it answers to
    version: str
    content_hash: str
    variant: str = ""  # its variant, when the model has several (default: the model's name)
    kl: float = 0.0  # that variant's measured next-token KL against the reference
    host: str = ""  # the process it computes in, shared with the workers of its other variants there
    worker_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )
    heartbeat_s: float = 1.0
    ttl_s: float = 4.0
    claim_idle_s: float = 10.0
    request_timeout: float = 600.0
    write_patience_s: float = 30.0


@dataclass
class _InFlight:
    stream: str
    entry_id: str
    attempt: int
    caller: Caller | None = None
    reserved: int = 0  # tokens this attempt took from its tenant's bucket: prompt + max_tokens
    prompt_tokens: int = 0
    completion_tokens: int = 0  # generated so far (what is not given back)

    @property
    def unused(self) -> int:
        return max(0, self.reserved - self.prompt_tokens - self.completion_tokens)


class FleetWorker:
    def __init__(self, engine: Engine, config: WorkerConfig) -> None:
        import redis

        self.engine, self.config = engine, config
        self.controls = EngineControls(engine)
        self.redis = redis.Redis.from_url(config.redis_url, socket_timeout=10, socket_connect_timeout=5)
        self.tokens = RedisTokens(self.redis)
        self.own = P.worker_stream(config.worker_id)
        self.variant = config.variant or config.name
        self.shared = P.model_stream(self.variant)
        self.knobs_version = ""
        self.patience = (
            0.0  # seconds a top-tier prompt waits here before a co-hosted cheaper variant gives way
        )
        self.capacity = engine.config.scheduler.max_num_seqs + engine.config.scheduler.max_queue // 4
        self.inflight: dict[str, _InFlight] = {}
        self.claimed = 0
        self.resumed_tokens = 0  # tokens of answers continued from a dead worker's attempt
        self._chunks: queue.Queue[tuple[str, P.Chunk, _InFlight | None] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.max_chars = engine.max_model_len * longest_token_chars(engine.tokenizer)
        self.forgets_seen = "-"  # the last entry of the fleet's `forgets` stream applied here
        self.intake = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qpack-fleet-intake")

    # ------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; Redis outages are waited out with backoff, never fatal."""
        engine_stop = threading.Event()
        threads = [
            threading.Thread(
                target=loop.run, args=(self.engine, engine_stop), name="qpack-engine", daemon=True
            ),
            threading.Thread(target=self._send_loop, name="qpack-fleet-sender", daemon=True),
        ]
        for thread in threads:
            thread.start()
        backoff = 0.5
        groups = False
        last_beat = last_claim = 0.0
        while not stop.is_set():
            try:
                if not groups:
                    self._ensure_groups()
                    self.replay_forgets()
                    groups = True
                if time.monotonic() - last_beat >= self.config.heartbeat_s:
                    self._heartbeat()
                    last_beat = time.monotonic()
                if time.monotonic() - last_claim > self.config.claim_idle_s / 3:
                    self.replay_forgets()
                    self._refresh_and_claim()
                    last_claim = time.monotonic()
                self._check_cancels()
                self._read_new()
                backoff = 0.5
            except Exception as exc:  # Redis down, restarted empty, or our stream removed: keep generating
                _log.warning("fleet worker: Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                groups, last_beat = False, 0.0
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self._stopping.set()
        self.intake.shutdown(wait=True, cancel_futures=True)
        self._chunks.put(None)
        engine_stop.set()
        self.engine.wake()
        for thread in threads:
            thread.join(timeout=10)

    def _ensure_groups(self) -> None:
        import redis

        for stream in (self.own, self.shared):
            try:
                self.redis.xgroup_create(stream, P.GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _heartbeat(self) -> None:
        """Announce this worker (and its engine's load, for the gateway's controller), and take up the knobs the
        controller last set for this model."""
        load = self.controls.load()
        info = P.WorkerInfo(
            self.config.worker_id,
            self.config.name,
            self.config.version,
            self.config.content_hash,
            self.capacity,
            len(self.inflight),
            time.time(),
            self.engine.config.prefill_dtype,
            self.variant,
            self.config.kl,
            load.waiting,
            load.running,
            load.finished,
            load.tokens,
            load.served,
            load.served_tokens,
            load.oldest,
            load.queued,
            self.config.host or self.config.worker_id,
        )
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(P.worker_key(self.config.worker_id), mapping=info.fields())
        pipe.expire(P.worker_key(self.config.worker_id), max(1, int(self.config.ttl_s)))
        pipe.hset(P.WORKERS, self.config.worker_id, self.variant)
        pipe.hgetall(P.control_key(self.config.name))
        *_done, knobs = pipe.execute()
        self._take_knobs(knobs)

    def _take_knobs(self, fields: P.Fields) -> None:
        data = {P.text(k): P.text(v) for k, v in (fields or {}).items()}
        if not data or data.get("version") == self.knobs_version:
            return
        try:
            knobs = P.knobs_from(data)
            patience = max(0.0, float(data.get("patience", 0.0)))
        except (KeyError, ValueError) as exc:
            _log.warning("fleet worker: ignoring malformed knobs %s (%s)", data, exc)
            return
        self.controls.configure(knobs)
        self.patience = patience
        self.knobs_version = data.get("version", "")

    # ------------------------------------------------------------------ taking work

    def _read_new(self) -> None:
        room = self.capacity - len(self.inflight)
        if room <= 0:
            time.sleep(0.02)
            return
        reply = self.redis.xreadgroup(
            P.GROUP, self.config.worker_id, {self.own: ">", self.shared: ">"}, count=room, block=100
        )
        for stream, entry_id, fields in P.stream_entries(reply):
            self._start(stream, entry_id, fields, attempt=1)

    def _refresh_and_claim(self) -> None:
        """Reset the idle clock of our own in-flight entries, then take over entries left by dead workers."""
        with self._lock:
            by_stream: dict[str, list[StreamIdT]] = {}
            for item in self.inflight.values():
                by_stream.setdefault(item.stream, []).append(item.entry_id)
        for stream, ids in by_stream.items():
            self.redis.xclaim(stream, P.GROUP, self.config.worker_id, 0, ids, justid=True)
        idle_ms = int(self.config.claim_idle_s * 1000)
        dead = self._dead_worker_streams()
        for stream in dead:
            self._adopt(stream)
        for stream in [self.shared, *dead]:
            room = self.capacity - len(self.inflight)
            if room <= 0:
                return
            try:
                _next, entries, *_ = self.redis.xautoclaim(
                    stream, P.GROUP, self.config.worker_id, idle_ms, "0-0", count=room
                )
            except Exception as exc:  # a stream without the group (a worker that never started): skip it
                _log.debug("cannot claim from %s: %s", stream, exc)
                continue
            for entry_id, fields in P.entries(entries):
                self.claimed += 1
                self._start(stream, entry_id, fields, attempt=2)

    def _dead_worker_streams(self) -> list[str]:
        """Streams of workers of this model whose heartbeat stopped."""
        streams = []
        for raw_id, raw_model in self.redis.hgetall(P.WORKERS).items():
            worker = P.text(raw_id)
            if worker == self.config.worker_id or P.text(raw_model) != self.variant:
                continue
            info = P.WorkerInfo.parse(self.redis.hgetall(P.worker_key(worker)))
            if info is None or time.time() - info.last_seen > self.config.ttl_s:
                stream = P.worker_stream(worker)
                if self.redis.exists(stream):
                    streams.append(stream)
                else:
                    self.redis.hdel(P.WORKERS, worker)
        return streams

    def _adopt(self, stream: str) -> None:
        """Take the entries routed to a dead worker that it never read (they are not pending, so no claim finds
        them); forget its stream once it is empty."""
        room = self.capacity - len(self.inflight)
        if room > 0:
            reply = self.redis.xreadgroup(P.GROUP, self.config.worker_id, {stream: ">"}, count=room)
            for _stream, entry_id, fields in P.stream_entries(reply):
                self._start(stream, entry_id, fields, attempt=1)
        if self.redis.xlen(stream) == 0:
            self.redis.delete(stream)
            self.redis.hdel(P.WORKERS, stream.removeprefix(P.worker_stream("")))

    def _start(self, stream: str, entry_id: str, fields: P.Fields, attempt: int) -> None:
        """Take one entry off a stream (the intake loop): a deletion is applied here, a request of another variant
        handed back, and a request of ours counted in flight at once and prepared on the intake pool, so that
        parsing and tokenizing a hostile prompt never holds up heartbeats, claims or reading."""
        if b"forget" in fields or "forget" in fields:
            self._forget(stream, entry_id, fields)
            return
        try:
            request = P.FleetRequest.decode(fields)
        except (ValueError, TypeError, KeyError) as exc:
            _log.warning("dropping a malformed fleet entry %s: %s", entry_id, exc)
            self.redis.xack(stream, P.GROUP, entry_id)
            return
        wanted = request.variant or request.model
        if wanted != self.variant:  # adopted from a worker of another variant: hand it back
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(P.model_stream(wanted), request.encode())
            pipe.xack(stream, P.GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            pipe.execute()
            return
        item = _InFlight(stream, entry_id, attempt)
        with self._lock:
            if request.request_id in self.inflight:
                return  # already ours (a claim racing our own read)
            self.inflight[request.request_id] = item
        self.intake.submit(self._prepared, request, item, attempt)

    def _prepared(self, request: P.FleetRequest, item: _InFlight, attempt: int) -> None:
        """A request taken in, on the intake pool: continue a previous attempt's answer, validate, tokenize,
        reserve and queue it, and say `accepted` (or answer the error). Anything unexpected (Redis gone) leaves
        the entry pending, for a claim to retry."""
        try:
            self._accept(request, item, attempt)
        except Exception as exc:
            with self._lock:
                if self.inflight.get(request.request_id) is item:
                    del self.inflight[request.request_id]
            _log.warning("fleet worker: could not take %s (%s); left for a retry", request.request_id, exc)

    def _accept(self, request: P.FleetRequest, item: _InFlight, attempt: int) -> None:
        chain = self._chain(request.request_id) if attempt > 1 else P.Chain()
        item.attempt = chain.attempt + 1
        try:
            headers = self._admit(request, item, chain)
        except (ApiError, Refusal) as refused:
            error = http_error(refused)
            with self._lock:
                self.inflight.pop(request.request_id, None)
            failed = P.Chunk(
                "error", status=error.status, error=error.body()["error"], headers=error.headers or None
            )
            self._reply(request.request_id, failed, item)
            return
        if headers is None:  # nothing left to generate, or cancelled while it was prepared
            return
        self._send(
            request.request_id,
            P.Chunk(
                "accepted",
                tokens=max(chain.tokens, 0),
                usage={"prompt_tokens": item.prompt_tokens},
                attempt=item.attempt,
                headers=headers or None,
            ),
        )

    def _chain(self, request_id: str) -> P.Chain:
        """What a previous attempt already delivered on the request's response stream."""
        chain = P.Chain()
        for _entry_id, fields in P.entries(self.redis.xrange(P.response_stream(request_id)) or []):
            try:
                chain.take(P.Chunk.decode(fields))
            except (ValueError, TypeError, KeyError):
                continue
        return chain

    def replay_forgets(self, batch: int = 1000) -> int:
        """Apply the fleet's kept deletions newer than the last applied here (all of them at start), each only to
        sessions last used before it was asked; how many were read."""
        read = 0
        while True:
            start = "-" if self.forgets_seen == "-" else "(" + self.forgets_seen
            found = list(P.entries(self.redis.xrange(P.FORGETS, min=start, count=batch) or []))
            for entry_id, fields in found:
                self.forgets_seen = entry_id
                try:
                    target = json.loads(P.text(fields.get(b"forget", fields.get("forget", ""))))
                    self.engine.forget_sessions(
                        str(target["tenant"]),
                        target.get("user"),
                        target.get("session_id"),
                        float(target["at"]),
                    )
                except (ValueError, TypeError, AttributeError, KeyError) as exc:
                    _log.warning("skipping a malformed kept deletion %s: %s", entry_id, exc)
            read += len(found)
            if len(found) < batch:
                return read

    def _forget(self, stream: str, entry_id: str, fields: P.Fields) -> None:
        """A session deletion broadcast by a gateway, within one tenant: drop its KV here, answer how many blocks
        went (-1: no such session here) on the gateway's reply stream, then acknowledge."""
        blocks, reply = None, None
        try:
            target = json.loads(P.text(fields.get(b"forget", fields.get("forget", ""))))
            reply = target.get("reply")
            blocks = self.engine.forget_sessions(
                str(target["tenant"]), target.get("user"), target.get("session_id")
            )
            _log.info("fleet worker: forgot %s blocks of a session of tenant %s", blocks, target["tenant"])
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            _log.warning("dropping a malformed forget entry %s: %s", entry_id, exc)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(stream, P.GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        if isinstance(reply, str) and reply.startswith(P.forget_reply_stream("")):
            pipe.xadd(reply, {"worker": self.config.worker_id, "blocks": -1 if blocks is None else blocks})
            pipe.expire(reply, 60)
        pipe.execute()

    def _admit(self, request: P.FleetRequest, item: _InFlight, chain: P.Chain) -> dict[str, str] | None:
        """Validate, tokenize, reserve the tokens and queue the request on the engine, continuing CHAIN's answer
        if a previous attempt delivered part of it; the x-ratelimit-* headers of the token reservation, None when
        nothing was left to generate. An ApiError or a Refusal carries what the client gets."""
        if time.time() > request.deadline:
            raise ApiError(504, "request timed out", kind="timeout")
        caller = self._caller(request)
        parsed, ids, params, shared = self._prepare(request, caller)
        item.caller, item.prompt_tokens = caller, len(ids)
        done = len(chain.ids)
        self.resumed_tokens += done
        if done:
            params = dataclasses.replace(params, max_tokens=params.max_tokens - done)
            if params.max_tokens < 1:
                self._finish_resumed(request, item, chain, len(ids))
                return None
        with self._lock:
            if self.inflight.get(request.request_id) is not item:
                return None  # cancelled while it was prepared
        headers = self._reserve(item, params.max_tokens) if chain.tokens < 0 else {}
        try:
            with engine_refusals("worker"):
                self.engine.add(
                    request.request_id,
                    ids,
                    params,
                    self._callback(request.request_id, item),
                    priority=request.priority,
                    timeout=max(0.1, request.deadline - time.time()),
                    cache_salt=str(request.body.get("cache_salt") or "").encode(),
                    owner=owner_of(caller, parsed),
                    shared=shared,
                    resume_ids=chain.ids,
                    resume_chars=chain.chars,
                )
        except ApiError:
            self._give_back(item)
            raise
        with self._lock:
            cancelled = self.inflight.get(request.request_id) is not item
        if cancelled:  # while it was queued: the cancel's abort came before the engine had it
            self.engine.abort(request.request_id)
            return None
        return headers

    @staticmethod
    def _caller(request: P.FleetRequest) -> Caller:
        """The gateway's stamp: the only identity a worker acts on."""
        try:
            return Caller.from_json(request.caller)
        except ValueError as exc:
            raise ApiError(
                500, f"the request carries no valid caller stamp ({exc})", kind="server_error"
            ) from None

    def _reserve(self, item: _InFlight, max_tokens: int) -> dict[str, str]:
        """prompt + max_tokens from the tenant's token bucket in Redis (this attempt is the first accepted)."""
        assert item.caller is not None
        wanted = item.prompt_tokens + max_tokens
        try:
            verdict = self.tokens.reserve(item.caller, wanted)
        except LimiterUnavailable:
            raise ApiError(
                503, "rate limits cannot be checked (Redis unreachable); retry", kind="unavailable"
            ) from None
        if not verdict.allowed:
            raise refusal(verdict, item.caller.tenant, wanted)
        if item.caller.tokens_per_minute is not None:
            item.reserved = wanted
        return verdict.headers

    def _give_back(self, item: _InFlight) -> None:
        """Return the whole reservation of a request the engine refused (it never ran; the pipeline of a
        finished answer returns what the others did not use)."""
        if item.caller is not None and item.reserved:
            pipe = self.redis.pipeline(transaction=False)
            self.tokens.refund(pipe, item.caller, item.reserved)
            pipe.execute()
            item.reserved = 0

    def _finish_resumed(self, request: P.FleetRequest, item: _InFlight, chain: P.Chain, prompt: int) -> None:
        """A previous attempt generated every token but died before saying so: only the end is missing."""
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": chain.tokens,
            "total_tokens": prompt + chain.tokens,
        }
        chunk = P.Chunk(
            "done", tokens=chain.tokens, finish_reason="length", usage=usage, attempt=item.attempt, ids=[]
        )
        self._reply(request.request_id, chunk, item)

    def _prepare(
        self, request: P.FleetRequest, caller: Caller
    ) -> tuple[GenerationRequest, list[int], SamplingParams, tuple[str, int] | None]:
        """The request as the single server reads it: parsed, token ids, sampling within the caller's limits, and
        the shared prefix it starts with (if its tenant shares one)."""
        engine = self.engine
        parsed = parse_request({**request.body, "seed": request.seed}, request.chat)
        check_text_size(parsed, self.max_chars, engine.max_model_len)
        ids = prompt_ids(parsed, engine.tokenizer, engine.vocab_size)
        shared = shared_tokens(parsed, ids, caller.shared_prefixes, engine.tokenizer)
        return parsed, ids, limited_params(parsed, len(ids), engine.max_model_len, caller), shared

    def _callback(self, request_id: str, item: _InFlight) -> Any:
        def callback(output: RequestOutput) -> None:
            item.completion_tokens = output.completion_tokens
            if not output.finished:
                self._send(
                    request_id,
                    P.Chunk(
                        "delta",
                        tokens=output.completion_tokens,
                        text=output.text,
                        attempt=item.attempt,
                        ids=output.token_ids,
                    ),
                )
                return
            if output.finish_reason in ("abort", "timeout", "error"):
                status = {"abort": 499, "timeout": 504, "error": 500}[output.finish_reason]
                chunk = P.Chunk(
                    "error",
                    status=status,
                    error=_error(status, f"request {output.finish_reason}", "server_error"),
                )
                if output.finish_reason == "abort" and request_id not in self.inflight:
                    return  # cancelled by us: the gateway is gone
            else:
                chunk = P.Chunk(
                    "done",
                    tokens=output.completion_tokens,
                    text=output.text,
                    finish_reason=output.finish_reason,
                    usage=_usage(output),
                    attempt=item.attempt,
                    ids=output.token_ids,
                )
            self._reply(request_id, chunk, item)

        return callback

    # ------------------------------------------------------------------ answering

    def _send(self, request_id: str, chunk: P.Chunk) -> None:
        chunk.worker = self.config.worker_id
        self._chunks.put((request_id, chunk, None))

    def _reply(self, request_id: str, chunk: P.Chunk, item: _InFlight) -> None:
        """The last chunk of a request; the entry is acknowledged once it is written."""
        chunk.worker = self.config.worker_id
        self._chunks.put((request_id, chunk, item))

    def _send_loop(self) -> None:
        while True:
            first = self._chunks.get()
            batch = [first]
            while not self._chunks.empty() and len(batch) < 256:
                batch.append(self._chunks.get_nowait())
            if any(item is None for item in batch):
                return
            self._write(batch)  # type: ignore[arg-type]

    def _write(self, batch: list[tuple[str, P.Chunk, _InFlight | None]]) -> None:
        """Write a batch of chunks (and acknowledge finished entries) in one round trip. While Redis is away the
        batch is retried with backoff for `write_patience_s`, then dropped: its clients' gateways time out at
        their deadlines, and unacknowledged entries are claimed and answered again (or refused as expired)."""
        give_up = time.monotonic() + self.config.write_patience_s
        delay = 0.1
        while True:
            try:
                self._pipeline(batch).execute()
                break
            except Exception as exc:
                if self._stopping.is_set() or time.monotonic() > give_up:
                    _log.warning(
                        "fleet worker: dropped %d answer chunks: Redis unavailable (%s)", len(batch), exc
                    )
                    break
                if delay == 0.1:
                    _log.warning("fleet worker: writing answers failed (%s); retrying", exc)
                self._stopping.wait(delay)
                delay = min(delay * 2, 2.0)
        with self._lock:
            for request_id, _chunk, item in batch:
                if item is not None:
                    self.inflight.pop(request_id, None)

    def _pipeline(self, batch: list[tuple[str, P.Chunk, _InFlight | None]]) -> Any:
        pipe = self.redis.pipeline(transaction=False)
        for request_id, chunk, item in batch:
            stream = P.response_stream(request_id)
            pipe.xadd(stream, chunk.encode(), maxlen=10_000)
            if item is not None or chunk.kind == "accepted":
                pipe.expire(stream, int(self.config.request_timeout) + 60)
            if item is not None:
                pipe.xack(item.stream, P.GROUP, item.entry_id)
                pipe.xdel(item.stream, item.entry_id)
                if item.caller is not None and item.reserved:
                    self.tokens.refund(pipe, item.caller, item.unused)
        return pipe

    def _check_cancels(self) -> None:
        with self._lock:
            ids = list(self.inflight)
        if not ids:
            return
        flags = self.redis.mget([P.cancel_key(r) for r in ids])
        for request_id, flag in zip(ids, flags, strict=True):
            if flag is not None:
                with self._lock:
                    item = self.inflight.pop(request_id, None)
                self.engine.abort(request_id)
                if item is not None:
                    self._chunks.put(
                        (request_id, P.Chunk("error", status=499, worker=self.config.worker_id), item)
                    )


def _error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": None, "code": str(status)}
