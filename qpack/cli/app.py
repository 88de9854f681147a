"""The typer app every command registers on, the global options, and the few helpers all commands share.

Heavy imports (torch, transformers) happen inside the commands, so `qpack --help` stays instant. Exit codes:
0 ok, 1 a quality gate failed, 2 bad input or usage (a `QpackError`: one line saying what, where, how to fix).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer

from qpack.console import Output
from quantize.common.errors import EXIT_GATE, QpackError
from quantize.common.version import __version__

T = TypeVar("T")

app = typer.Typer(
    name="qpack",
    help="Turn a Hugging Face causal LM into a smaller, faster, measured artifact, and serve it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
bench_app = typer.Typer(
    help="Speed, memory and load benchmarks against a baseline measured in the same run.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qpack {__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    ctx: typer.Context,
    json_output: bool = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    ctx.obj = Output(json_mode=json_output, quiet=quiet)


def output(ctx: typer.Context) -> Output:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Output) else Output()


def run(out: Output, call: Callable[[], T]) -> T:
    """Run a library call; a `QpackError` becomes its one-line message and exit code."""
    try:
        return call()
    except QpackError as exc:
        out.error(exc.message, exc.exit_code)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        out.error("interrupted; nothing was written", 130)
        raise typer.Exit(130) from None


def gate_exit(out: Output, passed: bool, reasons: list[str]) -> None:
    """Exit 1 with the reasons when a quality gate failed (the results were already written and shown)."""
    if not passed:
        out.stderr.print(f"[bold red]gate failed:[/] {'; '.join(reasons)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_GATE)


def ints(text: str, option: str) -> tuple[int, ...]:
    """Comma-separated positive integers ('1,4,16')."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise QpackError(f"{option} must be comma-separated integers (got {text!r})") from None
    if not values or any(v < 1 for v in values):
        raise QpackError(f"{option} must list positive integers (got {text!r})")
    return values


def formats(value: str) -> tuple[str, ...]:
    """--format letter|cloze|both as the tuple of MMLU formats to score."""
    return ("letter", "cloze") if value == "both" else (value,)


def sizes(text: str, option: str) -> int:
    """Bytes from '2GB', '512MiB'... (QpackError naming the option otherwise)."""
    from quantize.common.sizes import parse_size

    try:
        return parse_size(text, option)
    except ValueError as exc:
        raise QpackError(str(exc)) from None


def memory_limit(text: str | None) -> int | None:
    """--max-memory: bytes, a fraction of the memory free now, or None (the library's default)."""
    if text is None:
        return None
    from quantize.common.memory import available_memory
    from quantize.common.sizes import parse_size

    try:
        return parse_size(text, "--max-memory", available_memory())
    except ValueError as exc:
        raise QpackError(str(exc)) from None
