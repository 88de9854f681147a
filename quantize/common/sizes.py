"""Sizes as users write them: `512MB`, `2GiB`, `8G`, `1e9`, or a fraction (`0.25`) of some total.

Every option that takes an amount of memory or disk (`--kv-memory`, `--max-memory`, `--max-shard-size`,
`--kv-host-memory`, `--kv-disk-size`) is parsed here, so they all accept the same spellings and reject the same
mistakes with the same message."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def parse_size(value: str | float | int, option: str, fraction_of: int | None = None) -> int:
    """Bytes from '512MB', '2GiB', '8G', 1e9; with `fraction_of`, '0.25' is that share of it. A bad value is a
    ValueError naming `option`."""
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(f"{option} {value!r} is not a size (e.g. 512MB, 8GB, 2GiB) or a fraction (0.25)")
        number, unit = float(match.group(1)), (match.group(2) or "").lower()
        if unit not in _UNITS:
            raise ValueError(f"{option} unit {unit!r} unknown; use MB, GB, MiB or GiB")
        value = number if unit == "" and number <= 1 else number * _UNITS[unit]
    if fraction_of is not None and 0 < float(value) <= 1:
        return int(float(value) * fraction_of)
    return int(value)
