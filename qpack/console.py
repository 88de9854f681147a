"""Terminal output for the CLI: rich progress on stderr, results on stdout, one-line errors.

Results go to stdout (a rich table, or one JSON document with `--json` so CI can parse it); progress and
warnings go to stderr so they never corrupt that JSON. `--quiet` silences everything but errors.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgressBar
from rich.table import Table

from quantize.common.progress import NULL_PROGRESS, Progress, Task


class _RichTask:
    def __init__(self, bar: RichProgressBar, task_id: Any) -> None:
        self._bar = bar
        self._task_id = task_id

    def advance(self, amount: float = 1.0) -> None:
        self._bar.advance(self._task_id, amount)


class RichProgress:
    """`quantize.common.progress.Progress` drawn with rich on stderr."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._bar: RichProgressBar | None = None
        self._depth = 0

    @contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        if self._bar is None:
            self._bar = RichProgressBar(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
            )
            self._bar.start()
        self._depth += 1
        started = time.perf_counter()
        task_id = self._bar.add_task(description, total=total)
        try:
            yield _RichTask(self._bar, task_id)
        finally:
            self._bar.remove_task(task_id)
            self._depth -= 1
            if self._depth == 0:
                self._bar.stop()
                self._bar = None
            self._console.print(
                f"[green]✓[/] {description} [dim]({time.perf_counter() - started:.1f} s)[/]", highlight=False
            )

    def log(self, message: str) -> None:
        self._console.print(message, highlight=False)


LOG_WIDTH = 160  # columns when writing to a file or pipe (a CI log) and COLUMNS is not set


def console(stderr: bool = False) -> Console:
    """A rich console; when the stream is not a terminal (`make demo > log`, a CI step) it renders at COLUMNS or
    LOG_WIDTH columns instead of rich's default 80, which squeezed wide tables into wrapped, cut-off cells."""
    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not (hasattr(stream, "isatty") and stream.isatty()):
        columns = os.environ.get("COLUMNS", "")
        width = int(columns) if columns.isdigit() and int(columns) > 0 else LOG_WIDTH
    return Console(stderr=stderr, soft_wrap=False, width=width)


@dataclass
class Output:
    json_mode: bool = False
    quiet: bool = False
    stdout: Console = field(default_factory=console)
    stderr: Console = field(default_factory=lambda: console(stderr=True))

    def progress(self) -> Progress:
        return NULL_PROGRESS if self.quiet else RichProgress(self.stderr)

    def error(self, message: str, exit_code: int) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps({"ok": False, "exit_code": exit_code, "error": message}) + "\n")
        self.stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            self.stderr.print(f"[bold yellow]warning:[/] {message}", highlight=False, soft_wrap=True)

    def result(self, data: dict[str, Any], *renderables: Any) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
            return
        if self.quiet:
            return
        for renderable in renderables:
            self.stdout.print(renderable)


def kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table
