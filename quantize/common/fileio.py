"""File helpers shared by every writer: hashing, atomic directories, strict JSON.

Outputs (calibration directories, artifacts, reports) are written into a sibling temp directory and renamed
into place, so a crash or a bad input never leaves a half-written output where a user or a CI step would find
it. A process killed outright (SIGKILL, OOM) cannot clean up, so each partial directory records its owner (host
and pid): the next write to the same output removes partials whose owner on this host is gone. Outputs get the
user's umask like any file they create (temp files and directories start private). Hashes are streamed so 500 MB
weight files do not need to fit in memory twice.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from quantize.common.errors import QpackError

_CHUNK = 4 * 1024 * 1024


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_files(paths: list[Path], root: Path | None = None) -> str:
    """One digest over several files, order-independent, names included (relative to `root`)."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: str(p.relative_to(root) if root else p.name)):
        name = str(path.relative_to(root)) if root else path.name
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(sha256_file(path).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file in the same directory, then rename), with the user's umask."""
    text = json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False) + "\n"
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file atomically (temp file in the same directory, then rename), with the user's umask."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise QpackError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QpackError(f"{what} {path} is not valid JSON ({exc}); regenerate it") from None


def check_output_dir(path: Path, overwrite: bool, what: str) -> None:
    """Refuse to clobber an existing output unless asked, before any work is done."""
    if path.exists() and not overwrite:
        raise QpackError(
            f"{what} {path} already exists; set `overwrite` to replace it or choose another path"
        )
    if path.exists() and not path.is_dir():
        raise QpackError(f"{what} {path} exists and is not a directory; remove it or choose another path")
    parent = path.parent
    if not parent.exists():
        raise QpackError(f"parent directory of {what} {path} does not exist; create {parent} first")


_ORPHAN_AGE_S = (
    3600.0  # a partial with no owner record (killed within microseconds of creating it, or written
)
# by an older qpack) is removed once it is this old


def _owner_file(partial: Path) -> Path:
    """Beside the partial directory, not in it: the directory's files are the output's, hashed as they are."""
    return partial.with_name(partial.name + ".owner")


def partial_dir(path: Path) -> Path:
    """A fresh `.{name}.XXXX.partial` directory beside `path`, with the user's umask, its owner (host, pid)
    recorded beside it; stale partials of the same output left by dead processes on this host go first."""
    remove_stale_partials(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    os.chmod(tmp, 0o777 & ~umask())
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    _owner_file(tmp).write_text(json.dumps(owner))
    return tmp


def discard_partial(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    _owner_file(partial).unlink(missing_ok=True)


def remove_stale_partials(path: Path) -> list[Path]:
    """Remove `.{name}.*.partial` / `.old` directories beside `path` whose owning process is gone; returns them."""
    removed = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.*"):
        if candidate.suffix in (".partial", ".old") and candidate.is_dir() and _abandoned(candidate):
            discard_partial(candidate)
            removed.append(candidate)
    return removed


def _abandoned(partial: Path) -> bool:
    try:
        owner = json.loads(_owner_file(partial).read_text())
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return time.time() - partial.stat().st_mtime > _ORPHAN_AGE_S
        except OSError:
            return False
    if host != socket.gethostname():
        return False  # another machine's writer (a shared disk): not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextmanager
def atomic_output_dir(path: Path, overwrite: bool, what: str) -> Iterator[Path]:
    """Yield a temp directory beside `path`; on success it replaces `path` in one rename.

    On any exception the temp directory is removed and an existing `path` is left untouched.
    """
    path = path.resolve()
    check_output_dir(path, overwrite, what)
    tmp = partial_dir(path)
    try:
        yield tmp
        _owner_file(tmp).unlink(missing_ok=True)
        if path.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            backup.rmdir()
            os.replace(path, backup)
            os.replace(tmp, path)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        discard_partial(tmp)
        raise
