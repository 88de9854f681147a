"""The `qpack` command line: one module per command group, each command parsing its options, calling one
library function and rendering the result (`render`); `app` holds the typer app and what commands share."""

from __future__ import annotations

import sys

from qpack.cli.app import app

# isort: off
# Each module registers its commands on import; `qpack --help` lists them in this, the pipeline's, order.
from qpack.cli import calibration, quantization, evaluation, serving, benchmarks, pipeline

# isort: on

__all__ = ["app", "main"]
_COMMANDS = (calibration, quantization, evaluation, serving, benchmarks, pipeline)


def main() -> None:
    from quantize.memory import release_freed_memory

    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command != "serve":  # a server reuses same-size buffers every step: see quantize/memory.py
        release_freed_memory()
    try:
        app()
    except SystemExit:
        raise
    except BrokenPipeError:  # pragma: no cover - `qpack ... | head`
        sys.exit(0)
