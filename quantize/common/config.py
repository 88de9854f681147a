"""Typed configs: validation that names the field, documentation that every interface reads.

Each library entry point takes a frozen dataclass config. Its `validate()` collects every problem at once, each a
`Problem(field, message)`, and raises `ConfigError`, whose message names the fields the way a Python caller wrote
them ("invalid QuantizeConfig: target_bits must be in [2, 32] (got 40); ..."). A field is documented by the string
literal under it (an attribute docstring, which editors show); `field_docs` reads them. The command line builds its
options from the same fields and docs (`qpack/cli/fields.py`) and renders the same problems with its flag names
("invalid quantize options: --target-bits must be in [2, 32] (got 40)"), so an option is spelled once: the field.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import re
import textwrap
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from quantize.common.errors import QpackError

_MENTION = re.compile(r"`([a-z_][a-z0-9_.]*)`")


@dataclass(frozen=True)
class Problem:
    """What is wrong with one field of a config."""

    field: str  # the field, dotted for nested configs ("gptq.damp")
    message: (
        str  # the problem without the field's name ("must be in [2, 32] (got 40)"); other fields in backticks
    )


class ConfigError(QpackError):
    """A config with problems (every one found), named by field; exit code 2 like any bad input."""

    def __init__(self, config: str, problems: Iterable[Problem]) -> None:
        self.config = config
        self.problems = tuple(problems)
        super().__init__(f"invalid {config}: " + "; ".join(f"{p.field} {p.message}" for p in self.problems))

    def renamed(self, what: str, name: Callable[[str], str]) -> QpackError:
        """The same problems as another interface names the fields (the CLI: `--target-bits`), including fields a
        message mentions in backticks ("shorter than `min_tokens` 4")."""
        return QpackError(
            f"invalid {what}: "
            + "; ".join(f"{name(p.field)} {mentions(p.message, name)}" for p in self.problems)
        )


def mentions(message: str, name: Callable[[str], str]) -> str:
    """`message` with each field it names in backticks as `name` calls it (other backticked words as they are)."""

    def rename(match: re.Match[str]) -> str:
        renamed = name(match.group(1))
        return match.group(0) if renamed == match.group(1) else renamed

    return _MENTION.sub(rename, message)


class Problems:
    """Problems found while validating a config: `check` each rule, then `raise_if_any`."""

    def __init__(self) -> None:
        self.found: list[Problem] = []

    def check(self, ok: bool, field: str, message: str) -> None:
        if not ok:
            self.found.append(Problem(field, message))

    def add(self, field: str, message: str) -> None:
        self.found.append(Problem(field, message))

    def check_choice(self, value: object, field: str, choices: Collection[object]) -> None:
        """`value` must be one of `choices` (the message lists them)."""
        self.check(value in choices, field, one_of(value, choices))

    def nested(self, prefix: str, validate: Callable[[], None]) -> None:
        """The problems a nested config's `validate` raises, under `prefix.` (its field in this config)."""
        try:
            validate()
        except ConfigError as error:
            self.found += [Problem(f"{prefix}.{p.field}", p.message) for p in error.problems]

    def raise_if_any(self, config: object) -> None:
        if self.found:
            raise ConfigError(type(config).__name__, self.found)


def one_of(value: object, choices: Iterable[object]) -> str:
    """The message for a value outside its choices: "must be one of a, b, c (got 'x')"."""
    return f"must be one of {', '.join(map(str, choices))} (got {value!r})"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the docstring under it} for a dataclass and its bases (empty where the source is unavailable)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def json_value(value: Any) -> Any:
    """Any config or result as JSON data: objects with a `to_json` by it, other dataclasses field by field,
    paths as strings, tuples as lists."""
    if hasattr(value, "to_json") and not isinstance(value, type):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return fields_json(value)
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def fields_json(value: Any) -> dict[str, Any]:
    """A dataclass instance's fields as JSON data (what a `to_json` method usually returns)."""
    return {f.name: json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
