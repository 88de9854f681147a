"""A request body's JSON, parsed with bounds a hostile client cannot get past.

Python's `json` recurses once per nesting level and converts integer literals with `int()`: a body nested
100,000 deep raises RecursionError, and a 5,000-digit integer raises ValueError (Python's 4,300-digit limit for
int-from-str). Either would reach the server as a bug (a 500, or a dropped connection) instead of the client's
mistake. So, before `json.loads` runs, the bytes outside strings are measured: the nesting depth as a running
sum over the brackets (linear, vectorized, no recursion) and the longest run of digits. Past `MAX_JSON_DEPTH`
levels or `MAX_INT_DIGITS` digits the body is refused; NaN, Infinity and numbers that overflow a float are
refused while parsing. The body must be UTF-8 (RFC 8259). Each refusal is one `BodyRejected` line saying what,
where and how to fix it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

import numpy as np

MAX_JSON_DEPTH = 64  # levels of objects and arrays, the body itself the first; OpenAI bodies use under 10
MAX_INT_DIGITS = 64  # digits of an integer literal; int64 needs 19

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LONG_DIGITS = re.compile(rb"[0-9]{%d,}" % (MAX_INT_DIGITS + 1))
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as int8


class BodyRejected(ValueError):
    """The body is not JSON this server parses; the message is the client's one-line explanation."""


def load(raw: bytes) -> Any:
    """The JSON value of `raw`, or BodyRejected."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyRejected(
            f"the body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start}); send JSON in UTF-8"
        ) from None
    outside = _STRING.sub(b"", raw)  # what is not inside a string
    _check_depth(outside)
    _check_digits(outside, raw)
    try:
        return json.loads(text, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise BodyRejected(f"malformed JSON body: {exc}") from None
    except RecursionError:  # unreachable after _check_depth; kept so no body can ever be a 500
        raise BodyRejected(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None


def _check_depth(outside: bytes) -> None:
    """BodyRejected when objects and arrays nest deeper than MAX_JSON_DEPTH, brackets inside strings not
    counted: the deepest point is the largest running count of openers less closers, which also bounds how deep
    `json.loads` recurses into a malformed body before it finds the error."""
    brackets = outside.translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= MAX_JSON_DEPTH:
        return
    steps = np.frombuffer(brackets.translate(_STEPS), dtype=np.int8)
    if int(np.cumsum(steps, dtype=np.int32).max()) > MAX_JSON_DEPTH:
        raise BodyRejected(
            f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays; flatten it"
        )


def _check_digits(outside: bytes, raw: bytes) -> None:
    """BodyRejected for a number with a run of more than MAX_INT_DIGITS digits: an integer that long costs
    quadratic time to convert, and past 4,300 digits Python refuses it."""
    found = _LONG_DIGITS.search(outside)
    if found is not None:
        raise BodyRejected(
            f"a number in the body has {len(found.group()):,} digits, more than {MAX_INT_DIGITS} digits "
            f"(at byte {raw.find(found.group())}); send numbers that fit 64 bits"
        )


def _float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        _refuse_number(literal[:32])
    return value


def _constant(literal: str) -> NoReturn:
    _refuse_number(literal)


def _refuse_number(literal: str) -> NoReturn:
    raise BodyRejected(
        f"{literal} is not a JSON number (NaN and infinities are not JSON); send a finite number"
    )
