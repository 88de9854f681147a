"""The two stores below the pool: host memory and a directory on disk, each LRU by size.

Both hold encoded blocks (`codec`) under their 32-byte chain key and are used from two threads (the engine reads,
the write-through thread writes), so every operation takes the store's lock. The disk store keeps one file per block,
`DIR/ab/<64 hex>.kv`: a block is written to a temp file in the same directory and renamed, so a crash leaves
either the old file or the new one, never half of one; the LRU order survives a restart through the files'
modification times (a hit touches its file). One file per block rather than an embedded database: blocks are
written once and read whole, deletes (session privacy requests, eviction) are single unlinks, and a corrupted
file costs one block, never the store. A disk that fills up or turns read-only disables the disk store with one warning;
serving goes on with the pool and the host store. Each store says which keys left it (evicted, deleted, found unreadable) through
`on_evict`, after releasing its lock: the session index forgets blocks no store holds any more.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger("qpack.serve.offload")

Evicted = Callable[[list[bytes]], None]  # told, after the store's lock is released, which keys left it


def _ignore(_keys: list[bytes]) -> None:
    return None


class HostStore:
    """The host store: encoded blocks in one anonymous memory map of `capacity` bytes, cut into `page_size` pages; least
    recently used evicted first.

    Why not a dict of `bytes`: blocks are ~0.1-2 MB, above malloc's dynamic mmap threshold once a few have been
    freed, so they land on the heap. Evicting old blocks in LRU order while the writer thread allocates its
    transient buffers leaves holes the allocator cannot give back, and a 2 GB host store filled with 10,000 sessions
    measured 3.5 GB of RSS growth (`benchmarks/sessions.py`). Pages of one fixed map never move: the process
    holds at most `capacity` bytes for the host store however the blocks come and go (pages are touched on first use, so a
    host store that never fills never costs its full size). An entry is a list of page numbers; the unused tail of its
    last page (half a page per block on average: ~2.5% of a 318 KB block at 16 KiB pages) is the only waste.
    """

    name = "host"

    def __init__(self, capacity: int, page_size: int = 16 * 1024) -> None:
        self.capacity, self.page_size = capacity, page_size
        self.num_pages = capacity // page_size
        self._arena = mmap.mmap(-1, max(self.num_pages, 1) * page_size)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._items: OrderedDict[bytes, tuple[list[int], int]] = OrderedDict()  # key -> (pages, length)
        self._lock = threading.Lock()
        self.on_evict: Evicted = _ignore

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    @property
    def size(self) -> int:
        """Bytes of the map in use (whole pages)."""
        return (self.num_pages - len(self._free)) * self.page_size

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
            pages, length = entry
            view, size = memoryview(self._arena), self.page_size
            chunks = [view[page * size : (page + 1) * size] for page in pages]
            if chunks:
                chunks[-1] = chunks[-1][: length - (len(pages) - 1) * size]
            return b"".join(chunks)

    def put(self, key: bytes, data: bytes) -> bool:
        needed = -(-len(data) // self.page_size)
        if needed > self.num_pages:
            return False
        evicted: list[bytes] = []
        with self._lock:
            self._drop(key)
            while len(self._free) < needed:
                oldest = next(iter(self._items))
                self._drop(oldest)
                evicted.append(oldest)
            pages = [self._free.pop() for _ in range(needed)]
            view, size = memoryview(data), self.page_size
            for index, page in enumerate(pages):
                chunk = view[index * size : (index + 1) * size]
                self._arena[page * size : page * size + len(chunk)] = chunk
            self._items[key] = (pages, len(data))
        if evicted:
            self.on_evict(evicted)
        return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            dropped = self._drop(key)
        if dropped:
            self.on_evict([key])
        return dropped

    def _drop(self, key: bytes) -> bool:
        entry = self._items.pop(key, None)
        if entry is not None:
            self._free.extend(entry[0])
        return entry is not None


class DiskStore:
    """The disk store: one file per block under `folder`, least recently used evicted first, at most `capacity` bytes."""

    name = "disk"

    def __init__(self, folder: Path, capacity: int) -> None:
        self.folder, self.capacity = Path(folder), capacity
        self.size = 0
        self.enabled = True
        self.disabled_reason: str | None = None
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._evicted: list[bytes] = []  # keys that left under the lock, told once it is released
        self.on_evict: Evicted = _ignore
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._evicted.clear()
        except OSError as exc:
            self._disable(f"cannot use {self.folder} ({exc.strerror or exc})")

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def _tell(self) -> None:
        with self._lock:
            evicted, self._evicted = self._evicted, []
        if evicted:
            self.on_evict(evicted)

    def _path(self, key: bytes) -> Path:
        hex_key = key.hex()
        return self.folder / hex_key[:2] / f"{hex_key}.kv"

    def _scan(self) -> None:
        """Rebuild the index from the files (oldest access first), dropping temp files of a killed writer."""
        found = []
        for path in self.folder.glob("??/*"):
            if path.suffix != ".kv":
                path.unlink(missing_ok=True)
                continue
            try:
                stat = path.stat()
                found.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
            except (OSError, ValueError):
                continue
        for _mtime, key, size in sorted(found):
            self._index[key] = size
            self.size += size
        self._evict(0)

    def _disable(self, reason: str) -> None:
        if self.enabled:
            _log.warning("KV disk store disabled: %s; serving goes on from memory", reason)
        self.enabled, self.disabled_reason = False, reason

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if not self.enabled or key not in self._index:
                return None
            path = self._path(key)
            try:
                data = path.read_bytes()
                os.utime(path, (time.time(), time.time()))
            except OSError:
                data = None
                self._forget(key)
            else:
                self._index.move_to_end(key)
        if data is None:
            self._tell()
        return data

    def put(self, key: bytes, data: bytes) -> bool:
        if len(data) > self.capacity:
            return False
        with self._lock:
            if not self.enabled:
                return False
            path = self._path(key)
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)
                try:
                    with os.fdopen(fd, "wb") as handle:
                        handle.write(data)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                self._disable(f"writing {path} failed ({exc.strerror or exc})")
                return False
            self._forget(key, unlink=False)
            self._index[key] = len(data)
            self.size += len(data)
            self._evict(0)
        self._tell()
        return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            found = self._forget(key)
        self._tell()
        return found

    def _forget(self, key: bytes, unlink: bool = True) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self.size -= size
        if unlink:
            self._evicted.append(key)
            with contextlib.suppress(OSError):
                self._path(key).unlink(missing_ok=True)
        return True

    def _evict(self, incoming: int) -> None:
        while self._index and self.size + incoming > self.capacity:
            key = next(iter(self._index))
            self._forget(key)
