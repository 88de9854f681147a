"""qpack's core: model sources, quantization schemes and kernels, the planner and the artifact format.

`calibrate`, `evals` and `serve` build on this package; it never imports them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qpack")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
