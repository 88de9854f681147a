"""Fault injection for the atomic-update tests (test_atomic_update.py): `qpack` runs killed at every write.

    python kill_harness.py PLAN.json

PLAN: {"template": an artifact, "work": a folder, "argv": qpack's arguments, "{artifact}" standing for the copy}.
The harness imports qpack once, then forks one child per run, each on its own copy of the template, WORK/<n>:
run 0 goes to the end and records every filesystem change it makes under its copy; run n (1 to the number of
changes) is SIGKILLed at change n: just before a file is created, opened for writing, renamed, removed or has its
mode set, a folder made or removed, or halfway through a data write. Forking spares each run the imports; the parent runs no torch
op, so no thread pool is forked. WORK/runs.json gets {"changes": [[operation, path], ...], "runs": {n: how the
child ended}}; WORK/<n>.log what the child printed.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
ORIGINAL = {
    name: getattr(os, name)
    for name in (
        "open",
        "replace",
        "rename",
        "mkdir",
        "rmdir",
        "unlink",
        "remove",
        "chmod",
        "write",
    )
}
ORIGINAL_OPEN = builtins.open


class Faults:
    """Counts the changes under `root`; kills the process at change number `kill_at` (0: never)."""

    def __init__(self, root: Path, kill_at: int) -> None:
        self.root = str(root.resolve())
        self.kill_at = kill_at
        self.changes: list[tuple[str, str]] = []

    def inside(self, path: Any, dir_fd: int | None = None) -> str | None:
        if isinstance(path, int):
            full = os.readlink(f"/proc/self/fd/{path}")
        else:
            name = os.fsdecode(path)
            base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
            full = os.path.normpath(os.path.join(base, name))
        return full if full == self.root or full.startswith(self.root + os.sep) else None

    def change(self, operation: str, path: str) -> bool:
        """Record a change; True when the process is to die at it."""
        self.changes.append((operation, os.path.relpath(path, self.root)))
        return len(self.changes) == self.kill_at


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CountedWrites:
    """A file opened for writing under the root: each write is a change (killed halfway through its data)."""

    def __init__(self, handle: Any, faults: Faults, path: str) -> None:
        self.handle, self.faults, self.path = handle, faults, path

    def write(self, data: Any) -> int:
        if self.faults.change("write", self.path):
            self.handle.write(data[: len(data) // 2])
            self.handle.flush()
            die()
        return int(self.handle.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> CountedWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def install(faults: Faults) -> None:
    """Route the os functions that change files, and `open` for writing, through `faults`."""

    def guarded(name: str, operation: str, target: Callable[..., tuple[Any, int | None]]) -> None:
        original = ORIGINAL[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            path, dir_fd = target(*args, **kwargs)
            full = faults.inside(path, dir_fd) if path is not None else None
            if full is not None and faults.change(operation, full):
                die()
            return original(*args, **kwargs)

        setattr(os, name, wrapper)

    def opened(
        path: Any, flags: int, *_: Any, dir_fd: int | None = None, **__: Any
    ) -> tuple[Any, int | None]:
        return (path if flags & WRITE_FLAGS else None), dir_fd

    def renamed(
        src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> tuple[Any, int | None]:
        return dst, dst_dir_fd

    def one(path: Any, *_: Any, dir_fd: int | None = None, **__: Any) -> tuple[Any, int | None]:
        return path, dir_fd

    guarded("open", "create", opened)
    guarded("replace", "rename", renamed)
    guarded("rename", "rename", renamed)
    for name, operation in (
        ("mkdir", "mkdir"),
        ("rmdir", "rmdir"),
        ("unlink", "remove"),
        ("remove", "remove"),
        ("chmod", "chmod"),
        ("write", "write"),
    ):
        guarded(name, operation, one)

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        """`open` and `io.open` (which `os.fdopen` and pathlib call): a path or descriptor opened for writing."""
        full = faults.inside(file) if set(mode) & set("wax+") else None
        if full is not None and faults.change("open", full):
            die()
        handle = ORIGINAL_OPEN(file, mode, *args, **kwargs)
        return CountedWrites(handle, faults, full) if full is not None else handle

    builtins.open = io.open = open_


def child(copy: Path, kill_at: int, argv: list[str], work: Path) -> None:
    """One run of qpack on `copy`; never returns."""
    code = 70
    try:
        log = ORIGINAL["open"](str(work / f"{kill_at}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        faults = Faults(copy, kill_at)
        install(faults)
        sys.argv = ["qpack", *(arg.replace("{artifact}", str(copy)) for arg in argv)]
        from qpack.cli import main

        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        if kill_at == 0:
            (work / "changes.json").write_text(json.dumps(faults.changes))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    template, work, argv = Path(plan["template"]), Path(plan["work"]), list(plan["argv"])
    import matplotlib.font_manager
    import matplotlib.pyplot  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import evals.pipeline  # noqa: F401
    import qpack.cli  # noqa: F401

    runs: dict[int, str] = {}
    changes: list[list[str]] = []
    run = 0
    while run == 0 or run <= len(changes):
        copy = work / str(run)
        shutil.copytree(template, copy)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(copy, run, argv, work)
        runs[run] = ended(os.waitpid(pid, 0)[1])
        if run == 0:
            changes = json.loads((work / "changes.json").read_text()) if runs[0] == "exit 0" else []
            if not changes:
                break
        run += 1
    (work / "runs.json").write_text(json.dumps({"changes": changes, "runs": runs}))


if __name__ == "__main__":
    main()
