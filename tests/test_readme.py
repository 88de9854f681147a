"""What the README shows a user can import, they can: every `from PACKAGE import ...` in its Python blocks and
every `package.name(` it mentions is a public name of that package (in `__all__`)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
PACKAGES = ("quantize", "calibrate", "evals", "serve", "qpack")


def _shown_names() -> set[tuple[str, str]]:
    text = README.read_text()
    shown: set[tuple[str, str]] = set()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        for package, names in re.findall(r"^from (\w+) import ([\w, ]+)$", block, re.M):
            shown.update((package, name.strip()) for name in names.split(","))
    shown.update(re.findall(rf"`({'|'.join(PACKAGES)})\.(\w+)\(", text))
    return {(package, name) for package, name in shown if package in PACKAGES}


def test_every_name_the_readme_shows_is_exported() -> None:
    shown = _shown_names()
    assert ("quantize", "load_artifact") in shown and len(shown) > 10
    missing = []
    for package, name in sorted(shown):
        module = importlib.import_module(package)
        if name not in getattr(module, "__all__", ()) or not hasattr(module, name):
            missing.append(f"{package}.{name}")
    assert not missing, f"the README shows names its packages do not export: {', '.join(missing)}"
