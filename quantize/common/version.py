"""qpack's version, as installed (one distribution ships all five packages); written into every artifact,
calibration directory and report."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qpack")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+local"
