"""File helpers shared by every writer: hashing, atomic directories, strict JSON.

Outputs (calibration directories, artifacts, reports) are written into a sibling temp directory and renamed
into place, so a crash or a bad input never leaves a half-written output where a user or a CI step would find
it. Hashes are streamed so 500 MB weight files do not need to fit in memory twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from quantize.errors import QpackError

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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file in the same directory, then rename)."""
    text = json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
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
            f"{what} {path} already exists; pass --overwrite to replace it or choose another path"
        )
    if path.exists() and not path.is_dir():
        raise QpackError(f"{what} {path} exists and is not a directory; remove it or choose another path")
    parent = path.parent
    if not parent.exists():
        raise QpackError(f"parent directory of {what} {path} does not exist; create {parent} first")


@contextmanager
def atomic_output_dir(path: Path, overwrite: bool, what: str) -> Iterator[Path]:
    """Yield a temp directory beside `path`; on success it replaces `path` in one rename.

    On any exception the temp directory is removed and an existing `path` is left untouched.
    """
    path = path.resolve()
    check_output_dir(path, overwrite, what)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            backup.rmdir()
            os.replace(path, backup)
            os.replace(tmp, path)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
