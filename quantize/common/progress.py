"""Progress reporting that library code can use without knowing about terminals.

Library functions take an optional `Progress`; the CLI passes one backed by rich, tests pass nothing. Keeping
this a tiny protocol means long steps (GGUF conversion, forward passes, GPTQ) can show progress while the
library stays free of rendering code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class Task(Protocol):
    def advance(self, amount: float = 1.0) -> None: ...


class Progress(Protocol):
    def task(self, description: str, total: float | None = None) -> AbstractContextManager[Task]: ...

    def log(self, message: str) -> None: ...


class _NullTask:
    def advance(self, amount: float = 1.0) -> None:
        return None


class NullProgress:
    """The default: says nothing."""

    @contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        yield _NullTask()

    def log(self, message: str) -> None:
        return None


NULL_PROGRESS = NullProgress()
