"""Command-line options built from the library's config dataclasses, so an option is spelled once: the field.

A command lists the fields it exposes (`Option("target_bits")`); each option's flag, type, default and `--help`
come from the field (its annotation, default and docstring, `quantize.common.config.field_docs`) unless the option
says otherwise. Values that arrive as text become the field's object through the option's `parse` (a preset name
-> `PRESETS[name]`, `int8` -> `Int8()`); inputs that feed several fields or none (`--group-size`, `--damp`) are
options without a field, combined by the command's `build` hook. `Options.config` builds the (nested) config from
the parsed values and validates it; every problem, of parsing or validation, is then reported once under the
flags that the user typed (`ConfigError.renamed`).

Only the config modules are imported to build the options (they import no torch), so `qpack --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import typer

from quantize.common.config import ConfigError, Problems, field_docs, mentions
from quantize.common.errors import QpackError

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])
_REQUIRED = object()


class FieldProblem(ValueError):
    """Raised by a `parse` hook: what is wrong with the value given for one field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Option:
    """One command-line option, for a config field (dotted for nested configs) or, with `field=""`, an input the
    command's `build` hook combines (then `name` and `flags` are required)."""

    field: str
    flags: tuple[str, ...] = ()  # default: --the-field-name
    cli_type: Any = None  # the type typer parses (default: the field's, tuples as lists)
    default: Any = _REQUIRED  # default: the field's (a required option when it has none)
    parse: Callable[[Any], Any] | None = None  # the typed value -> the field's value
    help: str | None = None  # default: the field's docstring
    doc: tuple[type, str] | None = None  # or the docstring of this (dataclass, field) instead
    name: str | None = None  # the Python parameter (default: the field path, dots as underscores)
    argument: bool = False
    also: tuple[str, ...] = ()  # further fields the same value sets (--seed sets seed and sensitivity.seed)
    envvar: str | None = None  # an environment variable that gives the value when the flag is absent

    @property
    def parameter(self) -> str:
        return self.name or self.field.replace(".", "_")


@dataclass(frozen=True)
class _Field:
    owner: type
    name: str
    annotation: Any
    default: Any


class Options:
    """The options of one command over config class `config_class`."""

    def __init__(
        self,
        config_class: type[C],
        options: Sequence[Option | str],
        what: str,
        build: Callable[[dict[str, Any], Problems], dict[str, Any]] | None = None,
        names: Mapping[str, str] | None = None,
    ) -> None:
        """`build` receives every option's value by parameter name (parsed ones already turned into field values;
        those that failed to parse left out) and returns {field path: value} for the fields the plain options don't
        set, adding what is wrong to the problems; `names` gives the flag to show for fields no option sets directly
        (what `build` fills)."""
        self.config_class = config_class
        self.options = [Option(o) if isinstance(o, str) else o for o in options]
        self.what = what
        self.build = build
        self.extra_names = dict(names or {})

    def flags_of(self, option: Option) -> tuple[str, ...]:
        if option.flags:
            return option.flags
        return ("--" + option.field.rsplit(".", 1)[-1].replace("_", "-"),)

    def _field(self, path: str) -> _Field:
        owner: type = self.config_class
        parts = path.split(".")
        for index, part in enumerate(parts):
            fields = {f.name: f for f in dataclasses.fields(owner)}
            if part not in fields:
                raise TypeError(f"{owner.__name__} has no field {part!r} (option {path!r})")
            hints = typing.get_type_hints(owner)
            annotation = hints[part]
            if index < len(parts) - 1:
                owner = _dataclass_of(annotation)
                continue
            found = fields[part]
            if found.default is not dataclasses.MISSING:
                default = found.default
            elif found.default_factory is not dataclasses.MISSING:
                default = found.default_factory()
            else:
                default = _REQUIRED
            return _Field(owner, part, annotation, default)
        raise AssertionError(path)

    def _parameter(self, option: Option) -> inspect.Parameter:
        field = self._field(option.field) if option.field else None
        cli_type = (
            option.cli_type if option.cli_type is not None else _cli_type(field.annotation if field else None)
        )
        if cli_type is None:
            raise TypeError(
                f"option {option.field or option.name}: give cli_type and parse for this field type"
            )
        default = option.default
        if default is _REQUIRED and field is not None and field.default is not _REQUIRED:
            if option.parse is not None or option.cli_type is not None:
                raise TypeError(f"option {option.field}: a parsed option needs its command-line default")
            default = list(field.default) if isinstance(field.default, tuple) else field.default
        help_text = option.help
        if help_text is None and option.doc is not None:
            help_text = field_docs(option.doc[0]).get(option.doc[1])
        if help_text is None and field is not None:
            help_text = field_docs(field.owner).get(field.name)
        marker: Any = ... if default is _REQUIRED else default
        info = (
            typer.Argument(marker, help=help_text)
            if option.argument
            else typer.Option(marker, *self.flags_of(option), help=help_text, envvar=option.envvar)
        )
        return inspect.Parameter(
            option.parameter, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=cli_type
        )

    def command(self, function: F) -> F:
        """`function(ctx, **values)` with its signature replaced by `ctx` and these options (what typer reads)."""
        parameters = [
            inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
            *(self._parameter(o) for o in self.options),
        ]

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        del wrapper.__wrapped__  # typer must read this signature, not the function's
        return typing.cast(F, wrapper)

    def config(self, values: Mapping[str, Any], **fixed: Any) -> Any:
        """The validated config for the parsed `values` (and `fixed` top-level fields), or a QpackError naming
        the flags of every problem, of parsing or validation."""
        fields: dict[str, Any] = {}
        problems = Problems()
        parsed = dict(values)
        for option in self.options:
            value = values[option.parameter]
            if option.parse is not None and value is not None:
                try:
                    value = option.parse(value)
                except FieldProblem as error:
                    problems.add(error.field, str(error))
                    del parsed[option.parameter]
                    continue
                except (ValueError, QpackError) as error:
                    field = option.field or option.parameter
                    problems.add(field, _strip(str(error), self.flags_of(option)[0]))
                    del parsed[option.parameter]
                    continue
            parsed[option.parameter] = value
            if option.field:
                for path in (option.field, *option.also):
                    fields[path] = tuple(value) if isinstance(value, list) else value
        if self.build is not None:
            fields.update(self.build(parsed, problems))
        failed = {p.field for p in problems.found}
        try:
            config = _construct(self.config_class, {**fields, **fixed})  # the failed fields at their defaults
            validate = getattr(config, "validate", None)
            if validate is not None:
                validate()
        except ConfigError as error:
            problems.found += [p for p in error.problems if p.field not in failed]
        except TypeError:
            if not problems.found:  # a required field went missing without a reported reason: a bug here
                raise
        if problems.found:
            raise ConfigError(self.config_class.__name__, problems.found).renamed(
                f"{self.what} options", self.flag_for
            )
        return config

    def translated(self, call: Callable[[], C]) -> C:
        """`call()`, its errors in the command line's words: a ConfigError (a problem found only once the work
        started: an override matching no layer, an unreachable budget) named by flags like the others, and the
        fields any other error names in backticks shown as their flags."""
        try:
            return call()
        except ConfigError as error:
            raise error.renamed(f"{self.what} options", self.flag_for) from None
        except QpackError as error:
            renamed = QpackError(self.mention(error.message))
            renamed.exit_code = error.exit_code
            raise renamed from None

    def mention(self, message: str) -> str:
        """A library message with the fields it names in backticks shown as their flags."""
        return mentions(message, self.flag_for)

    @functools.cached_property
    def _names(self) -> dict[str, str]:
        names = dict(self.extra_names)
        for option in self.options:
            for path in (option.field, *option.also) if option.field else ():
                names.setdefault(path, self.flags_of(option)[0] if not option.argument else option.parameter)
        return names

    def flag_for(self, path: str) -> str:
        """The flag to name a field by: its option's, else the nearest enclosing field's, else the one option
        for a field of that name in a nested config (a generic message naming `overwrite`), else the path."""
        probe = path
        while probe:
            if probe in self._names:
                return self._names[probe]
            probe = probe.rpartition(".")[0]
        nested = {flag for known, flag in self._names.items() if known.rsplit(".", 1)[-1] == path}
        return nested.pop() if len(nested) == 1 else path


def _strip(message: str, flag: str) -> str:
    """A parse error's message without what the rendering adds again: "invalid ", the flag's own name."""
    return message.removeprefix("invalid ").strip().removeprefix(f"{flag}:").removeprefix(flag).strip()


def _dataclass_of(annotation: Any) -> type:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    raise TypeError(f"{annotation!r} is not a dataclass")


def _cli_type(annotation: Any) -> Any:
    """The type typer parses for a field: itself for str/int/float/bool/Path (optional too), a list for a tuple,
    str for a Literal; None where the field needs a `parse` (objects)."""
    from pathlib import Path

    simple = (str, int, float, bool, Path)
    if annotation in simple:
        return annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return str
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and (inner := _cli_type(rest[0])) is not None:
            return inner | None
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in simple:
        return list[args[0]]  # type: ignore[valid-type]
    return None


def _construct(cls: type[C], values: Mapping[str, Any]) -> C:
    """`cls(**top-level values)`, nested dataclass fields built from their defaults and `a.b` values."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for head, sub in nested.items():
        if head in top:
            top[head] = _replace(top[head], sub)
            continue
        found = fields[head]
        if found.default_factory is not dataclasses.MISSING:
            base = found.default_factory()
        elif found.default is not dataclasses.MISSING:
            base = found.default
        else:
            base = None
        top[head] = _replace(base, sub) if base is not None else _construct(_dataclass_of(hints[head]), sub)
    return cls(**top)


def _replace(base: Any, values: Mapping[str, Any]) -> Any:
    nested = {k: v for k, v in values.items() if "." in k}
    plain = {k: v for k, v in values.items() if "." not in k}
    if nested:
        for head in {k.split(".", 1)[0] for k in nested}:
            sub = {k.split(".", 1)[1]: v for k, v in nested.items() if k.startswith(head + ".")}
            plain[head] = _replace(getattr(base, head), sub)
    return dataclasses.replace(base, **plain)


def choice(mapping: Mapping[str, Any], field: str) -> Callable[[str], Any]:
    """A `parse` hook for a value named from `mapping` (a preset, an export)."""

    def parse(text: str) -> Any:
        if text not in mapping:
            raise FieldProblem(field, f"must be one of {', '.join(mapping)} (got {text!r})")
        return mapping[text]

    return parse


def each(parse: Callable[[str], Any]) -> Callable[[Iterable[str]], tuple[Any, ...]]:
    """A `parse` hook for a repeatable option: `parse` on every value."""
    return lambda values: tuple(parse(v) for v in values)
