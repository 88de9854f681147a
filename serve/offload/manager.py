"""Returning conversations: KV blocks written through to a host-memory store and a disk store, loaded back on a miss.

In a chat product most prompts are the whole conversation so far plus one new turn. The pool's prefix cache
keeps a conversation's blocks only until they are evicted, seconds under load; after that every turn would
recompute its whole history. So every full block the engine registers is also offered here: the engine thread
copies the block out of the pool and puts it on a bounded queue, never waiting (a full queue drops the copy and
counts it), and a writer thread encodes it (`codec`) into the host and disk stores. The queue is bounded in bytes as well as in
blocks (`queue_bytes`): its copies are memory the host store's budget does not count, and a 7B model's blocks are
megabytes each. When a request's prefix misses the pool, the engine asks `fetch` for the next keys of its chain:
consecutive hits from the host store, then the disk store (a disk hit is promoted to the host store), decoded and checked; the engine copies them into
pool blocks instead of recomputing them. A block that
fails its checks is counted, deleted from its store and recomputed.

Keys are the pool's own sha256 chain keys, whose root digests the artifact's content hash, the KV dtype, the
block size and the tenant's salt: a new artifact version never reads an old version's blocks, a restarted
server with the same artifact reads all of them, and tenants with different salts never share one.

Sessions: a request may name its `user` and a `session_id`, names inside its tenant (the API key's): the blocks
it registers are recorded under (tenant, user, session) (blocks, bytes, last use) in a bounded index (`sessions`:
an entry dies with its last stored block, each tenant keeps at most its `max_sessions`, least recently used
forgotten first). Deleting a session removes its blocks from every store, except blocks another session also holds
(a shared system prompt), and its blocks still queued for writing are never written; deleting a user removes all
of theirs; a deletion only ever sees the caller's tenant's sessions, and costs only theirs. `session_ttl` (or the
tenant's own) expires idle sessions the same way, on a housekeeping thread that also deletes the blocks of
sessions over a cap and appends what changed to the tenants' index logs every `save_interval` seconds, so
neither the engine thread nor a deletion's caller ever writes an index file. The index is kept beside the disk store's files,
one directory per engine (`serve.offload.sessions`), so a restarted server can still honour deletions; blocks
written after the last save are found again only if they are on disk and their session's log line was written.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from serve.core.request import SessionName
from serve.offload.codec import BlockLayout, CorruptBlock, decode, encode
from serve.offload.sessions import (
    DEFAULT_MAX_SESSIONS,
    LEGACY_FILE,
    IndexFiles,
    Session,
    SessionIndex,
    namespace,
    read_index,
    read_log,
    remove,
)
from serve.offload.stores import DiskStore, HostStore

_log = logging.getLogger("qpack.serve.offload")
__all__ = ["DEFAULT_MAX_SESSIONS", "OffloadManager", "OffloadStats", "Session"]


@dataclass
class OffloadStats:
    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    misses: int = 0
    corrupt: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    written: int = 0
    dropped: int = 0
    load_seconds: float = 0.0
    loaded_blocks: int = 0
    buried: int = 0  # blocks of deleted sessions that were queued and never written


class _Write(NamedTuple):
    key: bytes
    block: torch.Tensor  # a copy: the pool reuses its slots
    session: SessionName | None
    ttl: float | None  # its tenant's session TTL
    max_sessions: int | None  # its tenant's cap
    seq: int  # its place in the queue (deletions bury what was offered before them)


class OffloadManager:
    """The host and disk stores behind one write-through queue and one lookup, with the session index and its housekeeping."""

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
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        save_interval: float = 2.0,
        sweep_interval: float = 30.0,
    ) -> None:
        self.layout, self.host, self.disk, self.codec = layout, host, disk, codec
        self.session_ttl = session_ttl
        self.save_interval, self.sweep_interval = save_interval, sweep_interval
        self.stats = OffloadStats()
        self.on_event = on_event or (lambda _event, _store, _value: None)
        self.index = SessionIndex(max_sessions)
        self._lock = threading.Lock()
        self._offered = 0  # queue positions handed out (the engine thread offers)
        if queue_bytes is not None:
            queue_size = max(2, min(queue_size, queue_bytes // layout.raw_bytes))
        self._queue: queue.Queue[_Write | None] = queue.Queue(queue_size)
        self._doomed: queue.Queue[list[bytes] | None] = queue.Queue()  # keys the housekeeper deletes
        self._logged: dict[str, int] = {}  # lines in each tenant's log
        self._files = self._open_files()
        self.index.journaling = self._files is not None
        for store in (host, disk):
            if store is not None:
                store.on_evict = self._evicted
        self._thread = threading.Thread(target=self._run, name="qpack-kv-writer", daemon=True)
        self._thread.start()
        self._housekeeper = threading.Thread(target=self._housekeep, name="qpack-kv-sessions", daemon=True)
        self._housekeeper.start()

    @property
    def sessions(self) -> dict[SessionName, Session]:
        """The indexed sessions (a copy of the index's mapping: for tests and reports)."""
        with self._lock:
            return dict(self.index.items())

    # ------------------------------------------------------------------ engine thread

    @property
    def queue_capacity(self) -> int:
        """Blocks the write-through queue holds before it drops."""
        return self._queue.maxsize

    def offer(
        self,
        key: bytes,
        block: torch.Tensor,
        session: SessionName | None,
        ttl: float | None = None,
        max_sessions: int | None = None,
    ) -> bool:
        """Queue a copy of a registered block for the stores without waiting; False (counted) when the queue is
        full. `block` must already be a copy: the pool reuses its slots."""
        self._offered += 1
        try:
            self._queue.put_nowait(_Write(key, block, session, ttl, max_sessions, self._offered))
        except queue.Full:
            self.stats.dropped += 1
            self.on_event("dropped", "", 1)
            return False
        return True

    def fetch(self, keys: list[bytes], limit: int | None = None) -> list[torch.Tensor]:
        """Blocks for the leading keys found in the host or disk store, in order, stopping at the first miss or bad block."""
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
                _log.warning("KV %s store: dropped a bad block (%s); it will be recomputed", store.name, exc)
                continue
            self.stats.hits[store.name] += 1
            self.on_event("hit", store.name, 1)
            if store is self.disk and self.host is not None:
                self.host.put(key, data)
            return block
        return None

    def touch(
        self, session: SessionName | None, ttl: float | None = None, max_sessions: int | None = None
    ) -> None:
        """`session` is in use now (indexed if new; its tenant's oldest sessions beyond its cap are forgotten,
        their blocks deleted by the housekeeper)."""
        if session is not None:
            with self._lock:
                freed = self.index.use(session, ttl, max_sessions)
            if freed:
                self._doomed.put(freed)

    # ------------------------------------------------------------------ deletion (any thread but the engine's)

    def forget(
        self, tenant: str, user: str | None = None, session_id: str | None = None, before: float | None = None
    ) -> list[bytes] | None:
        """Remove a session's (or a user's) blocks from the host and disk stores, only ever among `tenant`'s sessions (and only
        sessions last used before `before`, when given); returns the keys removed, or None when the tenant has no
        such session (another tenant's is no different). Blocks another remaining session also holds are kept
        (and not returned); blocks of the session still queued for writing are never written. Costs the
        tenant's sessions (one lookup for a named session) and one unlink per block; the index file is written
        later, by the housekeeper."""
        with self._lock:
            freed = self.index.forget(tenant, user, session_id, before)
            if before is None and self._queue.unfinished_tasks:
                self.index.bury(self._offered, tenant, user, session_id)
        if freed is None:
            return None
        self._delete(freed)
        return freed

    def expire(self, now: float | None = None) -> int:
        """Forget sessions idle for longer than their tenant's TTL, else `session_ttl`; returns how many."""
        with self._lock:
            count, freed = self.index.expired(time.time() if now is None else now, self.session_ttl)
        self._delete(freed)
        return count

    def _delete(self, keys: list[bytes]) -> None:
        for key in keys:
            for store in (self.host, self.disk):
                if store is not None:
                    store.delete(key)

    def _evicted(self, keys: list[bytes]) -> None:
        """A store let these keys go: those no store holds any more leave the session index."""
        gone = [k for k in keys if not any(s is not None and k in s for s in (self.host, self.disk))]
        if gone:
            with self._lock:
                self.index.lost(gone)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:  # the writer must outlive one bad block
                _log.exception("KV write-through failed")
            finally:
                self._queue.task_done()

    def _write(self, item: _Write) -> None:
        session = item.session
        if session is not None and self._buried(item):
            return
        data = encode(self.layout, item.key, item.block, self.codec)
        for store in (self.host, self.disk):
            if store is not None and store.put(item.key, data):
                self.on_event("written", store.name, 1)
        self.stats.written += 1
        if session is None:
            return
        with self._lock:
            buried = self.index.buried(session, item.seq)
            if not buried:
                freed = self.index.use(session, item.ttl, item.max_sessions)
                self.index.add_key(session, item.key, len(data))
            self.index.written_up_to(item.seq)
            orphan = buried and item.key not in self.index.holders
        if buried:
            self.stats.buried += 1
            if orphan:
                self._delete([item.key])
        elif freed:
            self._delete(freed)

    def _buried(self, item: _Write) -> bool:
        assert item.session is not None
        with self._lock:
            buried = self.index.buried(item.session, item.seq)
            if buried:
                self.index.written_up_to(item.seq)
        if buried:
            self.stats.buried += 1
        return buried

    # ------------------------------------------------------------------ housekeeping thread

    def _housekeep(self) -> None:
        """Delete the blocks of sessions over a cap, expire idle sessions every `sweep_interval` seconds, and save
        the index files of tenants that changed every `save_interval` seconds."""
        last_sweep = last_save = time.monotonic()
        while True:
            taken = True
            try:
                keys = self._doomed.get(timeout=min(1.0, self.save_interval))
            except queue.Empty:
                keys, taken = [], False
            try:
                if keys is None:
                    return
                self._delete(keys)
                if time.monotonic() - last_sweep > self.sweep_interval:
                    self.expire()
                    last_sweep = time.monotonic()
                if time.monotonic() - last_save > self.save_interval:
                    self.save()
                    last_save = time.monotonic()
            except Exception:  # housekeeping must outlive one failure
                _log.exception("KV session housekeeping failed")
            finally:
                if taken:
                    self._doomed.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written and every doomed block deleted, then save the index (tests,
        shutdown)."""
        self._queue.join()
        self._doomed.join()
        self.save()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._doomed.put(None)
        self._thread.join(timeout=10)
        self._housekeeper.join(timeout=10)
        if self._files is not None:
            self._files.close()

    # ------------------------------------------------------------------ the session index beside the disk store

    def _open_files(self) -> IndexFiles | None:
        """This engine's index directory, with what it and engines of its model no longer running left there,
        and a legacy `sessions.json`; None without a disk store."""
        disk = self.disk
        if disk is None or not disk.enabled:
            return None
        layout = self.layout
        space = namespace(layout.model_hash.hex(), layout.dtype, layout.block_size, layout.shape)
        try:
            files = IndexFiles(disk.folder, space)
        except OSError as exc:
            _log.warning(
                "KV session index unusable in %s (%s); sessions are kept in memory only", disk.folder, exc
            )
            return None
        self._load(files.files())
        for _path, orphaned in files.orphans():
            if self._load(orphaned):
                self._save_to(files)
            remove(orphaned)
        legacy = disk.folder / LEGACY_FILE
        taken = files.dir / "legacy.json"
        try:
            legacy.rename(taken)  # one engine takes it over
        except OSError:
            return files
        self._load([taken])
        self._save_to(files)
        remove([taken])
        return files

    def _load(self, paths: list[Path]) -> int:
        """Index files, then their logs; the number of files read."""
        disk = self.disk
        assert disk is not None
        for path in paths:
            try:
                if path.suffix == ".log":
                    self.index.replay(read_log(path), disk.__contains__)
                    continue
                data = read_index(path)
                if data is not None:
                    self.index.merge(data, disk.__contains__)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                _log.warning("KV session index %s unreadable (%s); starting without it", path, exc)
        return len(paths)

    def save(self) -> None:
        """Append what changed since the last save to each tenant's log; a tenant whose log outgrew its sessions
        (or that was taken over) gets its file written whole instead."""
        if self._files is not None:
            self._save_to(self._files)

    def _save_to(self, files: IndexFiles) -> None:
        with self._lock:
            dirty, self.index.dirty = self.index.dirty, set()
            journal, self.index.journal = self.index.journal, {}
            for tenant, entries in journal.items():
                self._logged[tenant] = self._logged.get(tenant, 0) + len(entries)
                sessions = len(self.index.tenants.get(tenant, ()))
                if self._logged[tenant] > max(1000, 2 * sessions):
                    dirty.add(tenant)
        for tenant in sorted(dirty | set(journal)):
            try:
                if tenant in dirty:
                    with self._lock:
                        data = self.index.snapshot(tenant)
                        self._logged[tenant] = 0
                    files.write(tenant, data)
                else:
                    files.append(tenant, journal[tenant])
            except OSError as exc:
                _log.warning("KV session index of tenant %s not saved (%s)", tenant, exc)
                with self._lock:
                    self.index.dirty.add(tenant)
