"""The native kernels' C++ sources ship with the package: every file under csrc/ is package data, and every
translation unit the build compiles exists."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

from quantize.runtime.kernels import build

REPO = Path(__file__).resolve().parents[2]


def test_every_source_file_is_package_data_and_compiled_or_included() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["quantize.runtime.kernels"]
    files = sorted(p.name for p in build.SOURCE_DIR.iterdir())
    shipped = [f for f in files if any(fnmatch.fnmatch(f"csrc/{f}", pattern) for pattern in patterns)]
    assert shipped == files, f"not package data: {sorted(set(files) - set(shipped))}"
    assert set(build.SOURCES) <= set(files)
    headers = {f for f in files if f.endswith(".h")}
    included = {
        line.split('"')[1]
        for f in files
        for line in (build.SOURCE_DIR / f).read_text().splitlines()
        if line.startswith('#include "')
    }
    assert headers <= included, f"headers nothing includes: {sorted(headers - included)}"
    assert {f for f in files if f.endswith(".cpp")} == set(build.SOURCES)
