"""Named kinds of data, registered once: schemes by their type tag, algorithms by name.

Plans, manifests and caches store these objects as JSON carrying the name; reading them back looks the class up
here and builds it from the fields it has (keys it does not know, written by a newer qpack, are left out), so a new
kind registers itself instead of growing an `if name == ...` chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from quantize.common.errors import QpackError

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes of one kind by name (`key(cls)`), each registered once."""

    def __init__(self, what: str, key: Callable[[type[T]], str]) -> None:
        self.what = what
        self.key = key
        self.classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        """A class decorator."""
        name = self.key(cls)
        if name in self.classes:
            raise RuntimeError(f"{self.what} {name!r} registered twice")
        self.classes[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self.classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.classes)

    def __getitem__(self, name: str) -> type[T]:
        return self.classes[name]

    def get(self, name: str) -> type[T] | None:
        return self.classes.get(name)

    def class_of(self, name: object) -> type[T]:
        """The class registered as `name`; QpackError naming the known ones otherwise."""
        cls = self.classes.get(str(name))
        if cls is None:
            raise QpackError(f"unknown {self.what} {name!r}; known: {', '.join(self.classes)}")
        return cls

    def build(self, name: object, data: dict[str, Any]) -> T:
        """An instance of the class named `name` from JSON data: the dataclass fields it has, others left out."""
        cls = self.class_of(name)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})
