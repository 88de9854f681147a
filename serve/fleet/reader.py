"""A gateway's one reader of every open response stream: a single blocking XREAD over all of them, instead of
one per request.

With one XREAD per request, each token costs Redis a read call per client; with one reader, a call returns the
chunks of every stream that has new entries (a worker writes an engine step's chunks in one pipeline), so Redis
work per token falls with load instead of growing with it. A request that opens while the reader is blocked
would wait for the block to time out, so `open` wakes it with CLIENT UNBLOCK from the gateway's other
connection (one command per request). Entries persist in their streams, so nothing is lost to the order of
`open` and a worker's first write, to an outage, or to a reconnection: reading resumes from each stream's last
id. Redis failures are retried with backoff; each request's own deadline bounds its wait (`next`). Once closed
it stays closed: a request that opens a stream after the gateway shut the reader down is refused (`ReaderClosed`)
instead of starting a new read loop that nothing would ever stop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serve.fleet import wire as P

if TYPE_CHECKING:
    from redis.typing import KeyT, StreamIdT

_log = logging.getLogger("qpack.fleet")


class ReaderClosed(RuntimeError):
    """The reader was closed (the gateway is shutting down): no stream can be opened on it."""


@dataclass
class _Subscription:
    last: bytes = b"0-0"
    entries: asyncio.Queue[P.Fields] = field(default_factory=asyncio.Queue)


class ResponseReader:
    def __init__(self, url: str, control: Any, block_ms: int = 1000) -> None:
        import redis.asyncio as aioredis

        self.url, self.control, self.block_ms = url, control, block_ms
        self.connection = aioredis.Redis.from_url(
            url, single_connection_client=True, socket_timeout=block_ms / 1000 + 5, socket_connect_timeout=3
        )
        self.streams: dict[str, _Subscription] = {}
        self.client_id: int | None = None
        self.errors = 0
        self._blocked = False
        self._generation = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    @property
    def reading(self) -> bool:
        """Whether a read loop is running."""
        return self._task is not None and not self._task.done()

    async def open(self, stream: str) -> None:
        if self.closed:
            raise ReaderClosed("the gateway's response reader is closed (shutting down)")
        self.streams[stream] = _Subscription()
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        else:
            await self._wake()

    async def _wake(self) -> None:
        """Unblock the read in flight so that it restarts with the new stream; an UNBLOCK that arrives before
        the XREAD it meant to interrupt is retried for that same read."""
        generation = self._generation
        for _ in range(10):
            if not self._blocked or self.client_id is None or self._generation != generation:
                return
            try:
                if await self.control.client_unblock(self.client_id):
                    return
            except Exception:  # the reader is reconnecting: it picks the stream up when it is back
                self.errors += 1
                return
            await asyncio.sleep(0.001)

    def close(self, stream: str) -> None:
        self.streams.pop(stream, None)

    async def next(self, stream: str, timeout: float) -> P.Fields | None:
        """The fields of the stream's next entry, or None when `timeout` seconds pass first."""
        try:
            return await asyncio.wait_for(self.streams[stream].entries.get(), timeout)
        except TimeoutError:
            return None

    async def aclose(self) -> None:
        """Stop reading for good. The loop is told by the flag as well as by cancellation: redis-py may swallow
        a cancellation that lands in a blocking read, and the loop would then wait for streams forever."""
        self.closed = True
        self.streams.clear()
        self._changed.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.block_ms / 1000 + 1)
        await self.connection.aclose()

    async def _run(self) -> None:
        backoff = 0.1
        while not self.closed:
            if not self.streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                await self._read_once()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors += 1
                self.client_id, self._blocked = None, False
                _log.warning("fleet gateway: reading answers failed (%s); retrying in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _read_once(self) -> None:
        if self.client_id is None:
            self.client_id = int(await self.connection.client_id())
        self._changed.clear()
        wanted: dict[KeyT, StreamIdT] = {name: sub.last for name, sub in self.streams.items()}
        self._generation += 1
        self._blocked = True
        try:
            reply = await self.connection.xread(wanted, block=self.block_ms, count=256)
        finally:
            self._blocked = False
        for name, entry_id, fields in P.stream_entries(reply):
            sub = self.streams.get(name)
            if sub is not None:
                sub.last = entry_id.encode()
                sub.entries.put_nowait(fields)
