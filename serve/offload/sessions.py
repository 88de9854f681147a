"""The session index: which stored blocks each (tenant, user, session) holds, bounded, and cheap to delete from.

A tenant may name as many sessions as it likes (`user`, `session_id`), so the index must not grow with what a
tenant sends, nor may one tenant's sessions slow another's deletions. Hence:
- per tenant, its sessions in order of last use (`OrderedDict`): a deletion or expiry looks only at its tenant's
  sessions, expiry stops at the first session still in use, and a tenant over its cap (`max_sessions`) loses its
  least recently used sessions in O(1) each;
- per stored block, the sessions that hold it (`holders`): what a deletion frees is known without scanning other
  sessions, and when a store evicts or drops a block its holders lose it; a session whose last block went leaves
  the index;
- tombstones: a deletion records the write-through queue's position, so blocks of that session queued before it
  are never written (`dropped`).

The index lives in memory and beside the disk store (`IndexFiles`): one directory per engine (its model's namespace
and a slot number held with an exclusive `flock` while the engine runs), per tenant a JSON file written whole
(atomically) and a log of changes since (a line per block recorded, a line per session forgotten), appended by
a background thread: a deletion costs a line, and a tenant's file is written whole again only once its log
outgrows it (twice its sessions). Several engines can
share one kv_disk folder (`qpack serve A B`; `--role all` workers): each writes only its own directory, and an
engine starting up takes over the directories of engines of its model no longer running, so a restart finds
every engine's sessions. A crash between a deletion and the next save loses nothing that matters: the deleted
blocks' files are already gone, and on loading, keys no longer stored (and sessions left without any) are dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from quantize.common.fileio import write_bytes
from serve.core.request import SessionName

_log = logging.getLogger("qpack.serve.offload")
LEGACY_FILE = (
    "sessions.json"  # the one index file of earlier versions, shared (and clobbered) by every engine
)
INDEX_DIR = "sessions"
DEFAULT_MAX_SESSIONS = 10_000  # sessions one tenant may have indexed (tenants file: `max_sessions`)
_UNSCOPED = "default"  # the tenant of sessions an index of format 1 (before tenants) recorded
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

Local = tuple[str, str]  # (user, session id): a session's name inside its tenant


@dataclass
class Session:
    keys: dict[bytes, int] = field(default_factory=dict)  # key -> encoded bytes, in order of writing
    last_use: float = field(default_factory=time.time)
    ttl: float | None = None  # its tenant's session TTL, when that sets one

    @property
    def bytes(self) -> int:
        return sum(self.keys.values())


@dataclass(frozen=True)
class _Tombstone:
    seq: int  # the last write-through position offered before the deletion
    tenant: str
    user: str | None
    session_id: str | None

    def covers(self, name: SessionName, seq: int) -> bool:
        return (
            seq <= self.seq
            and name[0] == self.tenant
            and (self.user is None or name[1] == self.user)
            and (self.session_id is None or name[2] == self.session_id)
        )


class SessionIndex:
    """The index itself. Not thread-safe: `OffloadManager` calls it under its lock."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self.tenants: dict[str, OrderedDict[Local, Session]] = {}
        self.holders: dict[bytes, set[SessionName]] = {}
        self.dirty: set[str] = (
            set()
        )  # tenants whose index file must be written whole (taken over from others)
        self.journal: dict[str, list[dict[str, Any]]] = {}  # per tenant, changes not yet appended to its log
        self.journaling = False  # whether changes are kept for a log (only when there are files)
        self._tombstones: list[_Tombstone] = []

    def __len__(self) -> int:
        return sum(len(sessions) for sessions in self.tenants.values())

    def items(self) -> Iterator[tuple[SessionName, Session]]:
        for tenant, sessions in self.tenants.items():
            for (user, session_id), session in sessions.items():
                yield (tenant, user, session_id), session

    def use(
        self, name: SessionName, ttl: float | None, max_sessions: int | None, now: float | None = None
    ) -> list[bytes]:
        """Mark `name` used now (indexing it if new); the keys freed by forgetting its tenant's least recently
        used sessions beyond `max_sessions` (else the index's default)."""
        sessions = self.tenants.setdefault(name[0], OrderedDict())
        local = (name[1], name[2])
        session = sessions.get(local)
        if session is None:
            session = sessions[local] = Session(ttl=ttl)
        sessions.move_to_end(local)
        session.last_use, session.ttl = time.time() if now is None else now, ttl
        freed: list[bytes] = []
        cap = max(1, max_sessions or self.max_sessions)
        while len(sessions) > cap:
            oldest, victim = sessions.popitem(last=False)
            freed += self._release((name[0], *oldest), victim)
        return freed

    def add_key(self, name: SessionName, key: bytes, size: int, journal: bool = True) -> None:
        session = self.tenants[name[0]][(name[1], name[2])]
        session.keys[key] = size
        self.holders.setdefault(key, set()).add(name)
        if journal and self.journaling:
            line = {"n": name[0], "s": [name[1], name[2]], "t": session.last_use, "ttl": session.ttl}
            self.journal.setdefault(name[0], []).append({**line, "k": {key.hex(): size}})

    def lost(self, keys: list[bytes]) -> None:
        """These blocks are stored nowhere any more: their holders lose them, and a session left without any
        stored block leaves the index."""
        for key in keys:
            for tenant, user, session_id in self.holders.pop(key, ()):
                sessions = self.tenants.get(tenant)
                session = sessions.get((user, session_id)) if sessions is not None else None
                if sessions is None or session is None:
                    continue
                session.keys.pop(key, None)
                if not session.keys:
                    del sessions[(user, session_id)]
                    if not sessions:
                        del self.tenants[tenant]

    def forget(
        self, tenant: str, user: str | None, session_id: str | None, before: float | None = None
    ) -> list[bytes] | None:
        """Remove a tenant's session (both names given), a user's sessions (no `session_id`) or every session
        of that id (no `user`), looking only at that tenant's sessions; only sessions last used before `before`
        when given. The keys no other session holds (to delete from the stores), or None when none matched."""
        sessions = self.tenants.get(tenant)
        if sessions is None:
            return None
        if user is not None and session_id is not None:
            names = [(user, session_id)] if (user, session_id) in sessions else []
        else:
            names = [
                local
                for local in sessions
                if (user is None or local[0] == user) and (session_id is None or local[1] == session_id)
            ]
        if before is not None:
            names = [local for local in names if sessions[local].last_use < before]
        if not names:
            return None
        freed: list[bytes] = []
        for local in names:
            freed += self._release((tenant, *local), sessions.pop(local))
        if not sessions:
            del self.tenants[tenant]
        return freed

    def expired(self, now: float, default_ttl: float | None) -> tuple[int, list[bytes]]:
        """Forget every tenant's sessions idle past their TTL (else `default_ttl`), each tenant's from its least
        recently used up to its first live one: (sessions forgotten, keys freed)."""
        count, freed = 0, []
        for tenant in list(self.tenants):
            sessions = self.tenants[tenant]
            while sessions:
                local, session = next(iter(sessions.items()))
                ttl = session.ttl or default_ttl
                if ttl is None or now - session.last_use <= ttl:
                    break
                del sessions[local]
                freed += self._release((tenant, *local), session)
                count += 1
            if not sessions:
                del self.tenants[tenant]
        return count, freed

    def _release(self, name: SessionName, session: Session) -> list[bytes]:
        if self.journaling:
            self.journal.setdefault(name[0], []).append({"n": name[0], "f": [name[1], name[2]]})
        freed = []
        for key in session.keys:
            holders = self.holders.get(key)
            if holders is not None:
                holders.discard(name)
                if holders:
                    continue
                del self.holders[key]
            freed.append(key)
        return freed

    # ------------------------------------------------------------------ the write-through queue

    def bury(self, seq: int, tenant: str, user: str | None, session_id: str | None) -> None:
        """A deletion at queue position `seq`: blocks of the session queued up to there are not to be written."""
        self._tombstones.append(_Tombstone(seq, tenant, user, session_id))

    def buried(self, name: SessionName, seq: int) -> bool:
        return any(stone.covers(name, seq) for stone in self._tombstones)

    def written_up_to(self, seq: int) -> None:
        """The writer has taken every block up to `seq`: older tombstones can cover nothing more."""
        if self._tombstones:
            self._tombstones = [stone for stone in self._tombstones if stone.seq >= seq]

    # ------------------------------------------------------------------ the files' shape

    def snapshot(self, tenant: str) -> dict[str, Any]:
        sessions = self.tenants.get(tenant, OrderedDict())
        return {
            "format": 3,
            "tenant": tenant,
            "sessions": [
                {
                    "user": user,
                    "session": session_id,
                    "last_use": s.last_use,
                    "ttl": s.ttl,
                    "keys": {k.hex(): n for k, n in s.keys.items()},
                }
                for (user, session_id), s in sessions.items()
            ],
        }

    def merge(self, data: Any, stored: Any) -> int:
        """Sessions of an index file (format 3, or the legacy 1 and 2), only with the keys `stored(key)` says are
        still stored; the number merged. ValueError, KeyError, TypeError: not an index file."""
        items = data["sessions"]
        if data.get("format") == 3:
            items = [{**item, "tenant": data["tenant"]} for item in items]
        merged = 0
        for item in sorted(items, key=lambda i: float(i["last_use"])):
            keys = {bytes.fromhex(k): int(n) for k, n in item["keys"].items()}
            keys = {k: n for k, n in keys.items() if stored(k)}
            if not keys:
                continue
            ttl = item.get("ttl")
            name = (str(item.get("tenant", _UNSCOPED)), str(item["user"]), str(item["session"]))
            self.use(name, None if ttl is None else float(ttl), 10**9, now=float(item["last_use"]))
            for key, size in keys.items():
                self.add_key(name, key, size, journal=False)
            self.dirty.add(name[0])
            merged += 1
        return merged

    def replay(self, lines: list[str], stored: Any) -> None:
        """A tenant's log, appended since its file was last written whole: sessions that gained blocks (only
        those still stored count) and sessions forgotten, in order. A torn last line (a crash) is skipped."""
        for line in lines:
            try:
                entry = json.loads(line)
                tenant = str(entry["n"])
                self.dirty.add(tenant)
                if "f" in entry:
                    user, session_id = entry["f"]
                    self._drop(tenant, (str(user), str(session_id)))
                    continue
                keys = {bytes.fromhex(k): int(n) for k, n in entry["k"].items()}
                keys = {k: n for k, n in keys.items() if stored(k)}
                if not keys:
                    continue
                name = (tenant, str(entry["s"][0]), str(entry["s"][1]))
                ttl = entry.get("ttl")
                self.use(name, None if ttl is None else float(ttl), 10**9, now=float(entry["t"]))
                for key, size in keys.items():
                    self.add_key(name, key, size, journal=False)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                continue

    def _drop(self, tenant: str, local: Local) -> None:
        sessions = self.tenants.get(tenant)
        if sessions is not None and local in sessions:
            for key in sessions.pop(local).keys:
                holders = self.holders.get(key)
                if holders is not None:
                    holders.discard((tenant, *local))
                    if not holders:
                        del self.holders[key]
            if not sessions:
                del self.tenants[tenant]


def namespace(*parts: object) -> str:
    """A short name for an engine's blocks (its model, dtype, block size, shapes): its index directories'."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def tenant_file(tenant: str) -> str:
    """A tenant's index file name: its name when that is a safe file name (tenant names are), else a digest."""
    if _SAFE.match(tenant):
        return f"t-{tenant}.json"
    return f"h-{hashlib.sha256(tenant.encode()).hexdigest()}.json"


class IndexFiles:
    """One engine's index directory under `folder/sessions`: `<namespace>-<slot>`, held with an `flock` on its
    `lock` file for as long as the engine runs (another engine of the same model sharing the folder takes the
    next slot)."""

    def __init__(self, folder: Path, space: str) -> None:
        self.root, self.space = folder / INDEX_DIR, space
        self.root.mkdir(parents=True, exist_ok=True)
        self.dir, self._lock = self._claim()

    def _claim(self) -> tuple[Path, IO[bytes]]:
        for slot in range(10_000):
            path = self.root / f"{self.space}-{slot}"
            held = _try_lock(path)
            if held is not None:
                return path, held
        raise OSError(f"no free session index slot in {self.root}")

    def orphans(self) -> Iterator[tuple[Path, list[Path]]]:
        """Index directories of this model's engines that are not running (their lock is free): each with its
        files, held while the caller takes them over."""
        for path in sorted(self.root.glob(f"{self.space}-*")):
            if path == self.dir or not path.is_dir():
                continue
            held = _try_lock(path)
            if held is None:
                continue
            try:
                yield path, _files(path)
            finally:
                held.close()

    def path(self, tenant: str) -> Path:
        return self.dir / tenant_file(tenant)

    def files(self) -> list[Path]:
        """The tenants' files, then their logs (what a log says comes after its file)."""
        return _files(self.dir)

    def write(self, tenant: str, data: dict[str, Any]) -> None:
        """The tenant's file whole (atomically), then its log emptied: what the log said is in the file."""
        path = self.path(tenant)
        if data["sessions"]:
            write_bytes(path, json.dumps(data, separators=(",", ":")).encode())
        else:
            path.unlink(missing_ok=True)
        path.with_suffix(".log").unlink(missing_ok=True)

    def append(self, tenant: str, entries: list[dict[str, Any]]) -> None:
        """Changes to the tenant's sessions, one JSON line each, at the end of its log."""
        text = "".join(json.dumps(entry, separators=(",", ":")) + "\n" for entry in entries)
        with open(self.path(tenant).with_suffix(".log"), "a", encoding="utf-8") as handle:
            handle.write(text)

    def close(self) -> None:
        self._lock.close()


def _files(folder: Path) -> list[Path]:
    return [*sorted(folder.glob("*.json")), *sorted(folder.glob("*.log"))]


def _try_lock(path: Path) -> IO[bytes] | None:
    """The open lock file of index directory `path` (created if need be), exclusively locked; None when another
    process (or another engine of this one) holds it."""
    path.mkdir(parents=True, exist_ok=True)
    handle = open(path / "lock", "ab")  # noqa: SIM115 - held open as the lock
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def read_index(path: Path) -> Any:
    with contextlib.suppress(FileNotFoundError):
        return json.loads(path.read_text())
    return None


def read_log(path: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    return []


def remove(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
