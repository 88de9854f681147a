"""Returning conversations: KV blocks written through to host memory (T1) and disk (T2), loaded back on a miss.

In a chat product most prompts are the whole conversation so far plus one new turn. The pool's prefix cache
(T0) keeps a conversation's blocks only until they are evicted, seconds under load; after that every turn would
recompute its whole history. So every full block the engine registers is also offered here: the engine thread
copies the block out of the pool and puts it on a bounded queue, never waiting (a full queue drops the copy and
counts it), and a writer thread encodes it (`codec`) into T1 and T2. The queue is bounded in bytes as well as in
blocks (`queue_bytes`): its copies are memory the host tier's budget does not count, and a 7B model's blocks are
megabytes each. When a request's prefix misses T0, the engine asks `fetch` for the next keys of its chain:
consecutive hits from T1, then T2 (a T2 hit is promoted to T1), decoded and checked; the engine copies them into
pool blocks instead of recomputing them. A block that
fails its checks is counted, deleted from its tier and recomputed.

Keys are the pool's own sha256 chain keys, whose root digests the artifact's content hash, the KV dtype, the
block size and the tenant's salt: a new artifact version never reads an old version's blocks, a restarted
server with the same artifact reads all of them, and tenants with different salts never share one.

Sessions: a request may name its `user` and a `session_id`, names inside its tenant (the API key's): the blocks
it registers are recorded under (tenant, user, session) (blocks, bytes, last use). Deleting a session removes its
blocks from every tier, except blocks another session also holds (a shared system prompt); deleting a user removes
all of theirs; a deletion only ever sees the caller's tenant's sessions. `session_ttl` (or the tenant's own) expires
idle sessions the same way. The session index is kept beside T2's files, so a restarted server can still honour
deletions.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve.request import SessionName
from serve.tiers.codec import BlockLayout, CorruptBlock, decode, encode
from serve.tiers.stores import DiskStore, HostStore

_log = logging.getLogger("qpack.serve.tiers")
SESSIONS_FILE = "sessions.json"
_UNSCOPED = "default"  # the tenant of sessions an index of format 1 (before tenants) recorded


@dataclass
class Session:
    keys: dict[bytes, int] = field(default_factory=dict)  # key -> encoded bytes, in order of writing
    last_use: float = field(default_factory=time.time)
    ttl: float | None = None  # its tenant's session TTL, when that sets one

    @property
    def bytes(self) -> int:
        return sum(self.keys.values())


@dataclass
class TierStats:
    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    misses: int = 0
    corrupt: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    written: int = 0
    dropped: int = 0
    load_seconds: float = 0.0
    loaded_blocks: int = 0


_Write = tuple[bytes, torch.Tensor, SessionName | None, float | None]  # key, block copy, session, its TTL


class TieredKV:
    """T1 and T2 behind one write-through queue and one lookup."""

    def __init__(
        self,
        layout: BlockLayout,
        host: HostStore | None,
        disk: DiskStore | None,
        codec: str = "zstd",
        queue_size: int = 256,
        queue_bytes: int | None = None,
        session_ttl: float | None = None,
        on_event: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.layout, self.host, self.disk, self.codec = layout, host, disk, codec
        self.session_ttl = session_ttl
        self.stats = TierStats()
        self.on_event = on_event or (lambda _event, _tier, _value: None)
        self.sessions: dict[SessionName, Session] = {}
        self._lock = threading.Lock()
        if queue_bytes is not None:
            queue_size = max(2, min(queue_size, queue_bytes // layout.raw_bytes))
        self._queue: queue.Queue[_Write | None] = queue.Queue(queue_size)
        self._load_sessions()
        self._thread = threading.Thread(target=self._run, name="qpack-kv-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread

    @property
    def queue_capacity(self) -> int:
        """Blocks the write-through queue holds before it drops."""
        return self._queue.maxsize

    def offer(
        self, key: bytes, block: torch.Tensor, session: SessionName | None, ttl: float | None = None
    ) -> bool:
        """Queue a copy of a registered block for T1/T2 without waiting; False (counted) when the queue is
        full. `block` must already be a copy: the pool reuses its slots."""
        try:
            self._queue.put_nowait((key, block, session, ttl))
        except queue.Full:
            self.stats.dropped += 1
            self.on_event("dropped", "", 1)
            return False
        return True

    def fetch(self, keys: list[bytes], limit: int | None = None) -> list[torch.Tensor]:
        """Blocks for the leading keys found in T1 or T2, in order, stopping at the first miss or bad block."""
        blocks: list[torch.Tensor] = []
        started = time.perf_counter()
        for key in keys[:limit]:
            block = self._fetch_one(key)
            if block is None:
                self.stats.misses += 1
                self.on_event("miss", "", 1)
                break
            blocks.append(block)
        if blocks:
            seconds = time.perf_counter() - started
            self.stats.load_seconds += seconds
            self.stats.loaded_blocks += len(blocks)
            self.on_event("load_seconds", "", seconds)
        return blocks

    def _fetch_one(self, key: bytes) -> torch.Tensor | None:
        for store in (self.host, self.disk):
            if store is None:
                continue
            data = store.get(key)
            if data is None:
                continue
            try:
                block = decode(self.layout, key, data)
            except CorruptBlock as exc:
                store.delete(key)
                self.stats.corrupt[store.name] += 1
                self.on_event("corrupt", store.name, 1)
                _log.warning("KV %s tier: dropped a bad block (%s); it will be recomputed", store.name, exc)
                continue
            self.stats.hits[store.name] += 1
            self.on_event("hit", store.name, 1)
            if store is self.disk and self.host is not None:
                self.host.put(key, data)
            return block
        return None

    def touch(self, session: SessionName | None, ttl: float | None = None) -> None:
        if session is not None:
            with self._lock:
                entry = self.sessions.setdefault(session, Session(ttl=ttl))
                entry.last_use, entry.ttl = time.time(), ttl

    # ------------------------------------------------------------------ deletion (any thread)

    def forget(
        self, tenant: str, user: str | None = None, session_id: str | None = None
    ) -> list[bytes] | None:
        """Remove a session's (or a user's) blocks from T1 and T2, only ever among `tenant`'s sessions; returns the
        keys removed, or None when the tenant has no such session (another tenant's is no different). Blocks
        another remaining session also holds are kept (and not returned)."""
        with self._lock:
            doomed = [
                name
                for name in self.sessions
                if name[0] == tenant
                and (user is None or name[1] == user)
                and (session_id is None or name[2] == session_id)
            ]
            if not doomed:
                return None
            keys: dict[bytes, None] = {}
            for name in doomed:
                keys.update(dict.fromkeys(self.sessions.pop(name).keys))
            kept = {k for s in self.sessions.values() for k in s.keys}
            removed = [k for k in keys if k not in kept]
        for key in removed:
            for store in (self.host, self.disk):
                if store is not None:
                    store.delete(key)
        if doomed:
            self._save_sessions()
        return removed

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        last_sweep = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                item = None
                if time.monotonic() - last_sweep > 30:
                    self.expire()
                    last_sweep = time.monotonic()
                continue
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # the writer must outlive one bad block
                _log.exception("KV write-through failed")
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, block: torch.Tensor, session: SessionName | None, ttl: float | None) -> None:
        data = encode(self.layout, key, block, self.codec)
        for store in (self.host, self.disk):
            if store is not None and store.put(key, data):
                self.on_event("written", store.name, 1)
        self.stats.written += 1
        if session is not None:
            with self._lock:
                entry = self.sessions.setdefault(session, Session(ttl=ttl))
                entry.keys[key] = len(data)
                entry.last_use, entry.ttl = time.time(), ttl

    def expire(self, now: float | None = None) -> int:
        """Forget sessions idle for longer than their tenant's TTL, else `session_ttl`; returns how many."""
        now = time.time() if now is None else now
        with self._lock:
            idle = [
                name
                for name, s in self.sessions.items()
                if (ttl := s.ttl or self.session_ttl) is not None and now - s.last_use > ttl
            ]
        for tenant, user, session_id in idle:
            self.forget(tenant, user, session_id)
        return len(idle)

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()
        self._save_sessions()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the session index beside T2

    def _sessions_path(self) -> Path | None:
        return None if self.disk is None or not self.disk.enabled else self.disk.folder / SESSIONS_FILE

    def _save_sessions(self) -> None:
        path = self._sessions_path()
        if path is None:
            return
        with self._lock:
            data: dict[str, Any] = {
                "format": 2,
                "sessions": [
                    {
                        "tenant": t,
                        "user": u,
                        "session": s,
                        "last_use": v.last_use,
                        "ttl": v.ttl,
                        "keys": {k.hex(): n for k, n in v.keys.items()},
                    }
                    for (t, u, s), v in self.sessions.items()
                ],
            }
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data))
            tmp.replace(path)
        except OSError as exc:
            _log.warning("KV session index not saved (%s)", exc)

    def _load_sessions(self) -> None:
        path = self._sessions_path()
        if path is None or not path.is_file():
            return
        try:
            data = json.loads(path.read_text())
            for item in data["sessions"]:
                keys = {bytes.fromhex(k): int(n) for k, n in item["keys"].items()}
                ttl = item.get("ttl")
                name = (str(item.get("tenant", _UNSCOPED)), str(item["user"]), str(item["session"]))
                self.sessions[name] = Session(
                    keys, float(item["last_use"]), None if ttl is None else float(ttl)
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _log.warning("KV session index %s unreadable (%s); starting without it", path, exc)
