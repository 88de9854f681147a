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


def _type_checking_names(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    names.update(alias.asname or alias.name for alias in statement.names)
    return names


def test_each_librarys_lazy_exports_are_typed_and_resolve() -> None:
    """`__all__`, the lazily imported names and the `TYPE_CHECKING` block a type checker reads agree, and every
    name imports: a public name cannot be lazily exported but invisible to mypy, or typed but missing."""
    for package in ("quantize", "calibrate", "evals", "serve"):
        module = importlib.import_module(package)
        exported = set(module.__all__) - {"__version__"}
        typed = _type_checking_names(Path(module.__file__))
        assert typed == exported, (
            f"{package}: typed but not exported {typed - exported}, the reverse {exported - typed}"
        )
        submodules = {
            p.stem for p in Path(module.__file__).parent.iterdir() if p.suffix == ".py" or p.is_dir()
        }
        shadowed = exported & submodules  # importing such a submodule would replace the name with the module
        assert not shadowed, f"{package} exports names of its own submodules: {shadowed}"
        for name in sorted(exported):
            assert getattr(module, name) is not None, f"{package}.{name}"


INPUTS_LINE = 'MODEL, QUERIES, WORK = "smollm2-135m", (), Path("build")'


def _python_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def test_the_python_example_runs_as_written(
    tiny_llama: Path, queries_file: Path, mmlu_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The README's calibrate -> quantize -> evaluate -> load -> serve example, run as it stands; only its inputs
    line is swapped for a tiny model and its queries (SmolLM2 and ShareGPT would take minutes)."""
    code = _python_example()
    assert code.count(INPUTS_LINE) == 1, "the example's inputs line changed; update INPUTS_LINE"
    inputs = f"MODEL, QUERIES, WORK = {str(tiny_llama)!r}, ({str(queries_file)!r},), Path({str(tmp_path)!r})"
    monkeypatch.setenv("QPACK_MMLU_DIR", str(mmlu_dir))
    scope: dict[str, object] = {}
    exec(compile(code.replace(INPUTS_LINE, inputs), "README.md", "exec"), scope)
    quantized, evaluated, artifact = scope["quantized"], scope["evaluated"], scope["artifact"]
    assert quantized.quality.kl < 0.5 and evaluated.passed  # type: ignore[attr-defined]
    assert artifact.plan.schemes["model.layers.0.self_attn.q_proj"] is None  # type: ignore[attr-defined]
    assert artifact.plan.schemes["model.layers.1.mlp.down_proj"].label() == "int8"  # type: ignore[attr-defined]
    assert scope["engine"].max_model_len > 0  # type: ignore[attr-defined]
