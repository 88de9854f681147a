"""Where qpack keeps what it can rebuild: converted models, compiled kernels, reference scores.

One folder for every library (the user cache dir, or `QPACK_CACHE_DIR`), each user of it in its own subfolder
(`models/`, `native/`, `mmlu-reference/`...), so clearing it costs time, never results.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache dir (`QPACK_CACHE_DIR` overrides it)."""
    override = os.environ.get("QPACK_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("qpack"))
