"""Public names of a package, imported on first use (PEP 562): `from quantize import load_artifact` works, and
`import quantize` (every `qpack` start, `qpack --help`) does not import torch for it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` resolving each name in `exports` ({name: module}) on first access."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
