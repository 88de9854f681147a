"""What gateways and workers say to each other through Redis: key names and message shapes.

Layout (all keys under `qpack:`):
- `worker:{id}`: a hash a worker refreshes every second (model name, its variant and that variant's measured
  KL, version, content hash, capacity, load, and its engine's queue per tier, running and finished requests for
  the gateway's controller, last seen) with a short TTL; `workers` maps every worker id seen to its variant
  (kept after a worker dies, so its leftover entries go to a worker of the same variant: an answer is never
  continued on another variant; stale ones are skipped, empty ones removed).
- `w:{id}`: a worker's own request stream (sessions routed to it); `m:{variant}`: the variant's shared stream
  (requests without a session, or whose worker is full or gone). A model with one variant has one variant named
  as the model. Both have the consumer group `workers`:
  a worker reads its own stream and its model's shared stream with XREADGROUP, only as many entries as its
  scheduler has room for, and XACKs an entry when the request is answered. Entries a dead worker left pending
  are claimed by another worker with XAUTOCLAIM once idle for `claim_idle` (live workers re-claim their own
  in-flight entries to themselves every few seconds, which resets the idle clock, so only a dead or stuck
  worker's entries ever go idle that long).
- `resp:{request id}`: the request's response stream, one entry per output chunk, read by the gateway with
  XREAD from where it stopped. A per-request stream rather than pub/sub: entries persist until read (a gateway
  that reconnects, or a request whose worker died, reads from an index and loses nothing). Each chunk carries
  its attempt, the token count so far and its token ids; a worker that takes over a dead worker's request
  reads the stream and *continues* the answer from its last delivered token (attempt + 1; `Chain`), rather
  than regenerating it and relying on float-identical replay: the client sees one coherent answer with no
  duplicate and no gap, and no generated token is lost to a crash.
- `cancel:{request id}`: set by a gateway whose client went away; the worker aborts the request.
- `control:{model}`: the knobs the gateway's surge controller set (a hash with a version); workers read it with
  their heartbeat and apply it to their engine's scheduler.
- A `forget` entry (tenant, user, session, reply stream) in every live worker's own stream: a session deletion
  (privacy request) that each worker applies to its pool and tiers, only among that tenant's sessions, answering
  on the reply stream how many blocks it removed (-1: no such session there). Each deletion is also kept in
  `forgets`, a stream of the fleet's deletions (the newest `FORGETS_KEPT`), with the time it was asked: a worker
  that was down (or missed its heartbeat) when a deletion went out applies every kept one when it starts, and
  follows the stream while it runs, each only to sessions last used before that time, so a session begun again
  after its deletion is left alone, and applying one twice is harmless.
- Identity: the gateway authenticates the API key and stamps each request with its `caller` (tenant, tier,
  limits a worker applies; `serve.tenancy.Caller`); a worker acts on that stamp only, never on the body's
  `user`, `session_id` or `service_tier` as identity. Limits that must hold across gateways live under
  `qpack:limit:` (`serve.tenancy.redis_limits`).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from serve.engine.protocol import Knobs

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

Fields = dict[bytes | str, bytes | str]  # a stream entry's or a hash's fields, as redis-py reads them

PREFIX = "qpack:"
GROUP = "workers"
WORKERS = PREFIX + "workers"
FORGETS = PREFIX + "forgets"
FORGETS_KEPT = 100_000  # deletions kept for workers that were down (approximate trim)


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def entries(found: Iterable[tuple[bytes | str | None, Fields | None]]) -> Iterator[tuple[str, Fields]]:
    """(entry id, fields) of the entries of an XRANGE, XAUTOCLAIM or one stream of an XREAD reply; an entry
    deleted since it was delivered has no fields and is skipped."""
    for entry_id, fields in found:
        if entry_id is not None and fields:
            yield text(entry_id), fields


def stream_entries(reply: Any) -> Iterator[tuple[str, str, Fields]]:
    """(stream, entry id, fields) of an XREAD or XREADGROUP reply: [[stream, entries], ...] (RESP2, which the
    fleet's clients speak; redis-py types the reply as either protocol's shape), None when the read timed out."""
    for stream, found in reply or []:
        for entry_id, fields in entries(found):
            yield text(stream), entry_id, fields


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def worker_stream(worker_id: str) -> str:
    return f"{PREFIX}w:{worker_id}"


def model_stream(model: str) -> str:
    return f"{PREFIX}m:{model}"


def response_stream(request_id: str) -> str:
    return f"{PREFIX}resp:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}cancel:{request_id}"


def control_key(model: str) -> str:
    return f"{PREFIX}control:{model}"


@dataclass
class FleetRequest:
    """A request as a gateway queues it: the parsed OpenAI body, with everything that must not vary between a
    first run and a regeneration fixed (the seed, the deadline)."""

    request_id: str
    model: str
    chat: bool
    body: dict[str, Any]
    seed: int
    deadline: float  # unix time
    priority: int = 0
    session: str | None = None
    created: float = field(default_factory=time.time)
    caller: dict[str, Any] | None = (
        None  # the gateway's stamp (`Caller.to_json`): who is asking, at what tier
    )
    variant: str = ""  # the variant that must answer (routed or pinned); empty: the model's only one

    def encode(self) -> dict[FieldT, EncodableT]:
        return {"request": json.dumps(asdict(self))}

    @classmethod
    def decode(cls, fields: Fields) -> FleetRequest:
        raw = fields.get(b"request", fields.get("request"))
        if isinstance(raw, bytes):
            raw = raw.decode()
        return cls(**json.loads(str(raw)))


def knobs_fields(knobs: Knobs) -> dict[str, str]:
    """A controller's knobs as the fields of `control:{model}`, one per `Knobs` field (None as "")."""
    return {f.name: _field_text(getattr(knobs, f.name)) for f in dataclasses.fields(Knobs)}


def knobs_from(data: dict[str, str]) -> Knobs:
    """The knobs `knobs_fields` wrote (a field missing: its default); ValueError on a malformed value."""
    hints = typing.get_type_hints(Knobs)
    values: dict[str, Any] = {
        f.name: _field_value(data[f.name], hints[f.name]) for f in dataclasses.fields(Knobs) if f.name in data
    }
    return Knobs(**values)


def _field_text(value: object) -> str:
    if value is None:
        return ""
    return str(int(value)) if isinstance(value, bool) else str(value)


def _field_value(text: str, hint: Any) -> object:
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if text == "" and type(None) in kinds:
        return None
    kind = next(k for k in kinds if k is not type(None))
    if kind is bool:
        return bool(int(text))
    return kind(text)


def forget_entry(
    tenant: str, user: str | None, session_id: str | None, reply: str
) -> dict[FieldT, EncodableT]:
    return {"forget": json.dumps({"tenant": tenant, "user": user, "session_id": session_id, "reply": reply})}


def forget_record(
    tenant: str, user: str | None, session_id: str | None, at: float
) -> dict[FieldT, EncodableT]:
    """A deletion as `forgets` keeps it, for workers that were not there to answer."""
    return {"forget": json.dumps({"tenant": tenant, "user": user, "session_id": session_id, "at": at})}


def forget_reply_stream(token: str) -> str:
    return f"{PREFIX}forgot:{token}"


def new_seed() -> int:
    return secrets.randbelow(2**62)


@dataclass
class Chunk:
    """One entry of a response stream. kind: `accepted` (the worker validated and queued it), `delta` (text and
    the tokens generated so far), `done` (finish reason and usage) or `error` (HTTP status and message)."""

    kind: str
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    status: int = 0
    error: dict[str, Any] | None = None
    worker: str = ""
    attempt: int = 1
    ids: list[int] | None = None  # the token ids this delta (or the last one, in `done`) adds
    headers: dict[str, str] | None = (
        None  # `accepted` and `error`: x-ratelimit-* (and Retry-After) to pass on
    )

    def encode(self) -> dict[FieldT, EncodableT]:
        return {
            "chunk": json.dumps(
                {k: v for k, v in asdict(self).items() if v not in (None, "", 0) or k == "tokens"}
            )
        }

    @classmethod
    def decode(cls, fields: Fields) -> Chunk:
        raw = fields.get(b"chunk", fields.get("chunk"))
        if isinstance(raw, bytes):
            raw = raw.decode()
        return cls(**json.loads(str(raw)))


@dataclass
class Chain:
    """The one answer a client sees on a response stream that several attempts may have written to.

    A worker that takes over a request from a dead one continues the answer from what is on the stream (its
    `attempt` is one higher, its first delta starts at the token count it found), so a chunk joins the chain
    only if it comes from the newest attempt seen and starts exactly where the chain ends: the gateway uses
    this to deliver each token once, and a taking-over worker to find where to continue. Pure, no Redis."""

    attempt: int = 0
    tokens: int = -1  # -1 until the request is accepted
    ids: list[int] = field(default_factory=list)
    chars: int = 0

    def take(self, chunk: Chunk) -> bool:
        """Whether CHUNK extends the answer (and if so, extend it)."""
        if chunk.attempt < self.attempt:
            return False
        self.attempt = chunk.attempt
        if chunk.kind == "accepted":
            if self.tokens >= 0:
                return False
            self.tokens = 0
            return True
        if chunk.kind == "error":
            return True
        new = list(chunk.ids or [])
        if chunk.tokens - len(new) != max(self.tokens, 0) or (chunk.kind == "delta" and not new):
            return False
        self.tokens = chunk.tokens
        self.ids.extend(new)
        self.chars += len(chunk.text)
        return True


@dataclass
class WorkerInfo:
    worker_id: str
    model: str
    version: str
    content_hash: str
    capacity: int
    load: int
    last_seen: float
    prefill_dtype: str = "float32"  # how its engine prefills (workers of one model may differ)
    variant: str = ""  # the variant it serves (empty: the model's only one, named as the model)
    kl: float = 0.0  # that variant's measured next-token KL against the reference model
    waiting: dict[str, int] = field(default_factory=dict)  # its engine's queue per tier
    running: int = 0
    finished: int = 0  # requests its engine finished since it started
    tokens: int = 0  # tokens its engine computed since it started
    served: int = 0  # requests that ran and finished, and their tokens: what a request costs
    served_tokens: int = 0
    oldest: dict[str, float] = field(
        default_factory=dict
    )  # per tier: how long its oldest waiting one has waited
    queued: int = 0  # of the waiting, those without a seat yet (saturation)
    host: str = ""  # the process it computes in: engines of one host share its cores

    @property
    def room(self) -> int:
        return max(0, self.capacity - self.load)

    @property
    def variant_name(self) -> str:
        return self.variant or self.model

    @property
    def fingerprint(self) -> str:
        return f"qpack-{self.variant_name}-{self.version}-{self.content_hash[:12]}"

    def fields(self) -> dict[FieldT, EncodableT]:
        return {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in asdict(self).items()}

    @classmethod
    def parse(cls, fields: Fields) -> WorkerInfo | None:
        try:
            data = {text(k): text(v) for k, v in fields.items()}
            waiting = json.loads(data.get("waiting", "{}"))
            return cls(
                data["worker_id"],
                data["model"],
                data["version"],
                data["content_hash"],
                int(data["capacity"]),
                int(data["load"]),
                float(data["last_seen"]),
                data.get("prefill_dtype", "float32"),
                data.get("variant", ""),
                float(data.get("kl", 0.0)),
                {str(k): int(v) for k, v in waiting.items()} if isinstance(waiting, dict) else {},
                int(data.get("running", 0)),
                int(data.get("finished", 0)),
                int(data.get("tokens", 0)),
                int(data.get("served", 0)),
                int(data.get("served_tokens", 0)),
                {str(k): float(v) for k, v in json.loads(data.get("oldest", "{}")).items()},
                int(data.get("queued", 0)),
                data.get("host", ""),
            )
        except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError):
            return None
