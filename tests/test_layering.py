"""The rooms of the code base, checked: which package may import which, and how long a function may grow.

The four libraries are siblings on the core: `calibrate`, `evals` and `serve` import only `quantize`, and
`quantize` imports none of them. The application `qpack` (CLI, CI build, benchmarks) is the only package that
imports several libraries; the scripts in `benchmarks/` sit on top of everything. Imports inside functions count
(a lazy import is still a dependency). Run `pytest tests/test_layering.py -s` to print the import graph.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("quantize", "calibrate", "evals", "serve", "qpack")
ALLOWED: dict[str, set[str]] = {
    "quantize": set(),
    "calibrate": {"quantize"},
    "evals": {"quantize"},
    "serve": {"quantize"},
    "qpack": {"quantize", "calibrate", "evals", "serve"},
    "benchmarks": set(PACKAGES),
}
MAX_FUNCTION_LINES = 80
LONG_REASON = "Long because"  # a docstring that says why a function is longer than MAX_FUNCTION_LINES


def _sources(room: str) -> list[Path]:
    return sorted((REPO / room).rglob("*.py"))


def _imported_packages(path: Path) -> Counter[str]:
    found: Counter[str] = Counter()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in PACKAGES)
    return found


def import_graph() -> dict[str, Counter[str]]:
    """{room: Counter(imported package: import statements)}, edges to itself left out."""
    graph: dict[str, Counter[str]] = {}
    for room in ALLOWED:
        edges: Counter[str] = Counter()
        for path in _sources(room):
            edges.update(_imported_packages(path))
        edges.pop(room, None)
        graph[room] = edges
    return graph


def _render(graph: dict[str, Counter[str]]) -> str:
    lines = []
    for room, edges in graph.items():
        targets = ", ".join(f"{name} ({count})" for name, count in sorted(edges.items())) or "-"
        lines.append(f"  {room:<10} -> {targets}")
    return "import graph (statements per edge):\n" + "\n".join(lines)


def test_each_package_imports_only_what_its_room_allows() -> None:
    graph = import_graph()
    print(_render(graph))
    bad = [
        f"{room} -> {target}"
        for room, edges in graph.items()
        for target in edges
        if target not in ALLOWED[room]
    ]
    assert not bad, f"imports outside the layering rules: {', '.join(bad)}\n{_render(graph)}"


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n\ndef f():\n    from serve.engine import Engine\n    import quantize.common.errors\n"
    )
    assert _imported_packages(source) == Counter({"serve": 1, "quantize": 1})


def test_no_function_outside_tests_is_longer_than_a_screen_without_saying_why() -> None:
    long = []
    for room in ALLOWED:
        for path in _sources(room):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines whose docstring does not say '{LONG_REASON} ...': "
        + "; ".join(long)
    )
