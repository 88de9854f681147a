"""The rooms of the code base, checked: which package may import which, that no two files import each other (even
through others), which rooms of `quantize` a room may use, and how long a function may grow.

The four libraries are siblings on the core: `calibrate`, `evals` and `serve` import only `quantize`, and
`quantize` imports none of them. The application `qpack` (CLI, CI build, benchmarks) is the only package that
imports several libraries; the scripts in `benchmarks/` sit on top of everything. Inside `quantize`, `common` is
what everything may import and imports nothing else of ours; serving needs only `common`, `formats`, `runtime`,
`io` and `model`, never the offline quantizer. Imports inside functions and under `TYPE_CHECKING` count (a lazy
import is still a dependency). Run `pytest tests/test_layering.py -s` to print the import graph.
"""

from __future__ import annotations

import ast
import re
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
# Rooms of `quantize` a room may import, by the first part of the module path after `quantize.`.
QUANTIZE_ROOMS: dict[str, set[str]] = {
    "common": set(),
    "formats": {"common"},
    "runtime": {"common", "formats"},
}
SERVING_ROOMS = {"common", "formats", "runtime", "io", "model"}  # what `serve` may import of `quantize`
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """{module: modules it imports} over the five packages, each import resolved to the module file it names
    (`from a.b import c` is a.b.c where that is a module, else a.b)."""
    files = {_module_name(p): p for room in PACKAGES for p in _sources(room)}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.split(".")[0] in PACKAGES else None
                if found and found != name:
                    edges.add(found)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_files_import_each_other_even_through_others() -> None:
    cycles = import_cycles(module_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle_through_a_third_module() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "quantize" and len(parts) > 2 else None


def test_quantize_rooms_import_only_what_they_may() -> None:
    bad = []
    for module, edges in module_graph().items():
        room = _room(module)
        allowed = QUANTIZE_ROOMS.get(room or "")
        for target in edges:
            used = _room(target)
            if module.startswith("serve") and target.startswith("quantize") and used not in SERVING_ROOMS:
                bad.append(f"{module} -> {target} (serving uses only {', '.join(sorted(SERVING_ROOMS))})")
            if allowed is not None and target.startswith("quantize") and used != room and used not in allowed:
                bad.append(
                    f"{module} -> {target} (quantize.{room} may use {', '.join(sorted(allowed)) or 'nothing'})"
                )
    assert not bad, "; ".join(bad)


# The modules of `serve` that turn the command line's options into a running server; nothing below them (the engine,
# the KV cache and its offload, tenancy, control) may reach up into `serve.options`.
SERVE_OPTION_READERS = {
    "serve",
    "serve.launch",
    "serve.loading",
    "serve.fleet.run",
    "serve.fleet.worker_process",
    "serve.openai.routes",
}


def test_only_the_launchers_of_serve_read_its_command_line_options() -> None:
    bad = sorted(
        f"{module} -> serve.options"
        for module, edges in module_graph().items()
        if "serve.options" in edges and module.startswith("serve") and module not in SERVE_OPTION_READERS
    )
    assert not bad, f"imports running up into the CLI options: {', '.join(bad)}"


# The rooms of `serve`, bottom to top: a module may import its own layer and those below, never one above. The
# engine core's parts (scheduler, KV cache manager, block pool, runner, sampler) sit below the KV offload and
# speculation, which the engine's builder composes; the engine sits below the controller, tenancy and the variants
# that drive it (through `serve.engine.protocol`); HTTP and the fleet's front ends, the launchers and the command
# line's options are on top. Refusals go up as `serve.refusal.Refusal`, which the front ends map onto their answers.
SERVE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("serve.core", "serve.kv_formats", "serve.refusal", "serve.metrics"),
    ("serve.offload", "serve.speculative"),
    ("serve.engine",),
    ("serve.control", "serve.tenancy", "serve.variants"),
    (
        "serve",
        "serve.openai",
        "serve.fleet",
        "serve.server",
        "serve.launch",
        "serve.loading",
        "serve.http",
        "serve.options",
    ),
)


def _holds(room: str, module: str) -> bool:
    """Whether `room` holds `module` (the package `serve` itself holds only its `__init__`)."""
    return module == room or (room != "serve" and module.startswith(room + "."))


def serve_layer(module: str) -> int | None:
    """The layer of a module of `serve` (the longest room that holds it), None when no room does."""
    rooms = [(room, level) for level, layer in enumerate(SERVE_LAYERS) for room in layer]
    held = [(len(room), level) for room, level in rooms if _holds(room, module)]
    return max(held)[1] if held else None


def serve_room(module: str) -> str:
    return max((room for layer in SERVE_LAYERS for room in layer if _holds(room, module)), key=len)


def serve_graph() -> dict[str, Counter[str]]:
    """{room of serve: Counter(room it imports: import edges between their modules)}."""
    graph: dict[str, Counter[str]] = {}
    for module, edges in module_graph().items():
        if module.startswith("serve") and serve_layer(module) is not None:
            room = serve_room(module)
            found = graph.setdefault(room, Counter())
            found.update(serve_room(t) for t in edges if t.startswith("serve") and serve_layer(t) is not None)
            found.pop(room, None)
    return graph


def test_serve_imports_run_down_its_layers_only() -> None:
    graph = module_graph()
    unplaced = sorted(m for m in graph if m.startswith("serve") and serve_layer(m) is None)
    assert not unplaced, (
        f"modules of serve in no layer (add their room to SERVE_LAYERS): {', '.join(unplaced)}"
    )
    print("serve, bottom to top (imports between rooms):")
    rooms = serve_graph()
    for level, layer in enumerate(SERVE_LAYERS):
        for room in layer:
            targets = ", ".join(f"{t} ({n})" for t, n in sorted(rooms.get(room, Counter()).items())) or "-"
            print(f"  {level} {room:<18} -> {targets}")
    up = sorted(
        f"{module} (layer {serve_layer(module)}) -> {target} (layer {serve_layer(target)})"
        for module, edges in graph.items()
        if module.startswith("serve")
        for target in edges
        if target.startswith("serve") and (serve_layer(target) or 0) > (serve_layer(module) or 0)
    )
    assert not up, f"imports running up serve's layers: {'; '.join(up)}"


def test_the_layer_rule_catches_an_upward_import() -> None:
    assert serve_layer("serve.core.scheduler") == 0 and serve_layer("serve.engine.core") == 2
    assert (
        serve_layer("serve.openai.routes") == len(SERVE_LAYERS) - 1 and serve_layer("serve.nowhere") is None
    )
    assert (serve_layer("serve.openai.protocol") or 0) > (serve_layer("serve.tenancy.admission") or 0)


def _layout_rows() -> list[tuple[list[str], str]]:
    """The README's Layout table: (the rooms its first column names, the row)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [
        (re.findall(r"`([^`]+)`", line.split("|")[1]), line)
        for line in section.splitlines()
        if line.startswith("| `")
    ]


def test_the_readme_layout_table_matches_the_rooms_and_serve_layers() -> None:
    rows = _layout_rows()
    named = {room.rstrip("/") for rooms, _ in rows for room in rooms}
    missing = sorted(room for room in named if not (REPO / room).exists())
    assert not missing, f"the README's Layout table names rooms that do not exist: {', '.join(missing)}"
    packages = {
        room.replace(".", "/")
        for layer in SERVE_LAYERS
        for room in layer
        if (REPO / room.replace(".", "/")).is_dir()
    }
    unnamed = sorted((packages | set(PACKAGES)) - named)
    assert not unnamed, f"rooms the README's Layout table leaves out: {', '.join(unnamed)}"
    wrong = []
    for rooms, line in rows:
        layers = {
            serve_layer(room.rstrip("/").replace("/", ".")) for room in rooms if room.startswith("serve")
        }
        stated = re.search(r"\blayer (\d)", line)
        if layers and (stated is None or {int(stated.group(1))} != layers):
            wrong.append(f"{', '.join(rooms)}: layer {sorted(layers)} in tests/test_layering.py")
    assert not wrong, f"the README's Layout table states other serve layers: {'; '.join(wrong)}"


def test_configs_and_the_command_line_import_without_torch() -> None:
    """The configs every interface builds on are plain data, and the command line builds its options from them
    without torch (~2 s), so `qpack --help` stays instant."""
    import subprocess
    import sys

    configs = ["quantize.config", "calibrate.config", "evals.config", "serve.options", "qpack.cli"]
    check = (
        "import importlib, sys\n"
        f"for name in {configs!r}: importlib.import_module(name)\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n\ndef f():\n    from serve.engine.core import Engine\n    import quantize.common.errors\n"
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


def test_every_module_imports_first_on_its_own() -> None:
    """Each module imported first, with none of ours loaded: a cycle through a package's `__init__` (which the
    graph above does not see) fails here as a partially initialized module. One subprocess; third-party modules
    stay loaded between imports, ours are dropped."""
    import subprocess
    import sys

    names = [_module_name(p) for room in PACKAGES for p in _sources(room) if p.name != "__main__.py"]
    check = (
        "import importlib, sys\n"
        f"ours = {PACKAGES!r}\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for key in [k for k in sys.modules if k.split('.')[0] in ours]:\n"
        "        del sys.modules[key]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{name}: {exc}')\n"
        "assert not failed, failed\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, check=False, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
