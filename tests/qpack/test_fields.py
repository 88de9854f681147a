"""Command-line options built from config dataclasses: flags, types, defaults and help come from the fields, every
problem is reported once under the flag typed, and each command exposes every field of its config (or says why
not)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from qpack.cli.fields import FieldProblem, Option, Options, choice
from quantize.common.config import Problems, field_docs
from quantize.common.errors import QpackError

runner = CliRunner()


@dataclass(frozen=True)
class Inner:
    depth: int = 3
    """How deep."""


@dataclass(frozen=True)
class Outer:
    path: Path
    """Where to write."""
    count: int = 2
    """How many."""
    names: tuple[str, ...] = ()
    """Names to use."""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """The nested part."""
    mode: str = "fast"
    """fast or slow."""

    def validate(self) -> None:
        problems = Problems()
        problems.check(self.count >= 1, "count", f"must be at least 1 (got {self.count})")
        problems.check(self.inner.depth <= 5, "inner.depth", f"must be at most 5 (got {self.inner.depth})")
        problems.check(self.mode != "slow" or self.count < 10, "mode", "slow needs `count` under 10")
        problems.raise_if_any(self)


OPTIONS = Options(
    Outer,
    [
        Option("path", ("--path", "-p")),
        "count",
        Option("names", ("--name",)),
        Option("inner.depth", ("--depth",)),
        Option("mode", ("--mode",), str, "fast", choice({"fast": "fast", "slow": "slow"}, "mode")),
        Option("", ("--twice/--once",), bool, False, help="Double the count.", name="twice"),
    ],
    "toy",
    build=lambda values, problems: {"count": values["count"] * 2} if values["twice"] else {},
)
seen: list[Outer] = []
app = typer.Typer()


@app.command()
@OPTIONS.command
def toy(ctx: typer.Context, **values: Any) -> None:
    try:
        seen.append(OPTIONS.config(values))
    except QpackError as error:
        typer.echo(error.message, err=True)
        raise typer.Exit(2) from None


def test_flags_types_defaults_and_help_come_from_the_fields(tmp_path: Path) -> None:
    shown = runner.invoke(app, ["--help"])
    text = " ".join(shown.stdout.split())
    for fragment in ("--path", "-p", "Where to write.", "--count", "How many.", "--depth", "How deep."):
        assert fragment in text, fragment
    result = runner.invoke(
        app, ["-p", str(tmp_path), "--name", "a", "--name", "b", "--depth", "4", "--twice"]
    )
    assert result.exit_code == 0, result.output
    assert seen[-1] == Outer(tmp_path, count=4, names=("a", "b"), inner=Inner(depth=4))
    assert field_docs(Outer)["inner"] == "The nested part."


def test_every_problem_is_reported_once_under_its_flag(tmp_path: Path) -> None:
    result = runner.invoke(app, ["-p", str(tmp_path), "--count", "0", "--depth", "9", "--mode", "medium"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "invalid toy options: --mode must be one of fast, slow (got 'medium'); --count must be at least 1 (got 0); "
        "--depth must be at most 5 (got 9)"
    )
    result = runner.invoke(app, ["-p", str(tmp_path), "--count", "12", "--depth", "9", "--mode", "slow"])
    assert result.stderr.strip() == (
        "invalid toy options: --depth must be at most 5 (got 9); --mode slow needs --count under 10"
    )
    with pytest.raises(QpackError, match=r"^invalid Outer: count must be at least 1 \(got 0\)$"):
        Outer(tmp_path, count=0).validate()


def test_a_library_error_names_the_fields_as_flags_and_keeps_its_exit_code() -> None:
    def fail() -> None:
        error = QpackError("raise `count` or `inner.depth`; `unknown` stays")
        error.exit_code = 3
        raise error

    with pytest.raises(QpackError) as raised:
        OPTIONS.translated(fail)
    assert raised.value.message == "raise --count or --depth; `unknown` stays"
    assert raised.value.exit_code == 3


def test_an_option_for_a_field_that_does_not_exist_fails_when_the_command_is_defined() -> None:
    with pytest.raises(TypeError, match="Outer has no field 'colour'"):
        Options(Outer, ["colour"], "toy").command(toy)
    with pytest.raises(TypeError, match="needs its command-line default"):
        Options(Outer, [Option("mode", parse=str.upper)], "toy").command(toy)
    problem = FieldProblem("mode", "bad")
    assert problem.field == "mode" and str(problem) == "bad"


# Config fields each command leaves to Python callers, and why.
PYTHON_ONLY = {
    "quantize": {
        "sensitivity.pack_tokens": "an internal batching size",
        "sensitivity.fisher_samples": "a tuning constant of the Fisher estimate",
        "sensitivity.calibration_layers": "a tuning constant of the Fisher estimate",
    },
    "calibrate": {"coverage.min_token_coverage": "rarely changed; Python callers set it"},
    "evaluate": {"cache_dir": "tests and CI caches set it from Python"},
    "serve": {},
}


def _fields(cls: type, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        default = (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        )
        if dataclasses.is_dataclass(default) and field.name not in ("preset", "algorithm"):
            out |= _fields(type(default), f"{prefix}{field.name}.")
        else:
            out.add(prefix + field.name)
    return out


@pytest.mark.parametrize("command", ["quantize", "calibrate", "evaluate", "serve"])
def test_each_command_exposes_every_field_of_its_config(command: str) -> None:
    from qpack.cli.calibration import CALIBRATE
    from qpack.cli.evaluation import EVALUATE
    from qpack.cli.quantization import QUANTIZE
    from qpack.cli.serving import SERVE

    options = {"quantize": QUANTIZE, "calibrate": CALIBRATE, "evaluate": EVALUATE, "serve": SERVE}[command]
    covered = {path for o in options.options for path in (o.field, *o.also) if path} | set(
        options.extra_names
    )
    missing = _fields(options.config_class) - covered - set(PYTHON_ONLY[command])
    assert not missing, f"qpack {command} has no option for {sorted(missing)}"
