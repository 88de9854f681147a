"""The `qpack` command line: one module per command group, each command parsing its options, calling one
library function and rendering the result (`render`); `app` holds the typer app and what commands share."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from qpack.cli.app import app

# isort: off
# Each module registers its commands on import; `qpack --help` lists them in this, the pipeline's, order.
from qpack.cli import calibration, quantization, evaluation, serving, benchmarks, pipeline

# isort: on

__all__ = ["app", "main"]
_COMMANDS = (calibration, quantization, evaluation, serving, benchmarks, pipeline)


def _third_party_warnings_off() -> None:
    """Warnings raised inside other packages (torch, transformers, ...) are for their maintainers, not for the
    person running qpack: shown only with QPACK_SHOW_WARNINGS=1. qpack's own warnings always show."""
    if os.environ.get("QPACK_SHOW_WARNINGS") == "1":
        return
    ours = tuple(
        str(Path(__file__).resolve().parents[2] / room)
        for room in ("quantize", "calibrate", "evals", "serve", "qpack")
    )
    shown = warnings.showwarning

    def show(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if str(Path(filename).resolve()).startswith(ours):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main() -> None:
    from quantize.common.memory import release_freed_memory

    _third_party_warnings_off()

    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command != "serve":  # a server reuses same-size buffers every step: see quantize/common/memory.py
        release_freed_memory()
    try:
        app()
    except SystemExit:
        raise
    except BrokenPipeError:  # pragma: no cover - `qpack ... | head`
        sys.exit(0)
