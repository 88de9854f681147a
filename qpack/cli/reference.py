"""The option reference (`docs/cli.md`), generated from the command line itself: every command's arguments and
options with their types, defaults and help, which the CLI in turn builds from the config classes' docstrings. So
the reference can't drift from the code: `tests/qpack/test_cli.py` fails when the committed file is stale, and

    python -m qpack.cli.reference --write

regenerates it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import typer

from qpack.cli import app

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _is_argument(param: Any) -> bool:
    return type(param).__name__.endswith("Argument")


def _default(param: Any) -> str:
    if not _is_argument(param) and param.is_flag and param.secondary_opts:
        return f"`{param.opts[0] if param.default else param.secondary_opts[0]}`"
    value = param.default
    if value is None or value == () or callable(value):
        return ""
    return f"`{value}`"


def _names(param: Any) -> str:
    if _is_argument(param):
        return f"`{(param.metavar or param.name or '').upper()}`" + (" (required)" if param.required else "")
    names = [*param.opts, *param.secondary_opts]
    envvar = f" (env `{param.envvar}`)" if param.envvar else ""
    return " / ".join(f"`{n}`" for n in names) + envvar


def _command(path: str, command: Any, out: list[str]) -> None:
    """A command's section (typer's own click objects: duck-typed, as typer vendors click)."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            _command(f"{path} {name}", sub, out)
        return
    out += [f"## `{path}`", "", _cell(command.help or ""), ""]
    params = [p for p in command.params if (p.name or "") != "help"]
    if not params:
        return
    out += ["| option | type | default | what it does |", "| --- | --- | --- | --- |"]
    for param in params:
        help_text = getattr(param, "help", None) or ""
        kind = _cell(param.display_type(None)).strip("<>")
        out.append(f"| {_names(param)} | {kind} | {_default(param)} | {_cell(help_text)} |")
    out.append("")


def render() -> str:
    """docs/cli.md as the command line defines it now."""
    root = typer.main.get_command(app)
    out = [
        "# qpack command-line reference",
        "",
        "Generated from the command line by `python -m qpack.cli.reference --write`; a test fails when this file "
        "is stale. Exit codes: 0 ok, 1 a quality gate failed, 2 bad input or usage (one line: what, where, how to "
        "fix).",
        "",
    ]
    global_options = [p for p in root.params if (p.name or "") != "help"]
    out += ["## `qpack` (global options)", "", "| option | what it does |", "| --- | --- |"]
    out += [f"| {_names(p)} | {_cell(getattr(p, 'help', None) or '')} |" for p in global_options]
    out.append("")
    for name, command in getattr(root, "commands", {}).items():
        _command(f"qpack {name}", command, out)
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help=f"write {REFERENCE} (else print it)")
    args = parser.parse_args()
    text = render()
    if args.write:
        REFERENCE.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
