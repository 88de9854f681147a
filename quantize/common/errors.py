"""Errors that reach the user.

Every failure a user can fix is a `QpackError` whose message is one line: what is wrong, where, and how to fix
it. The CLI prints that line and exits with `exit_code`; a traceback is only for bugs. Quality gates are not
bugs either: they fail the build with exit code 1 and say which limit was crossed.
"""

from __future__ import annotations

EXIT_GATE = 1
EXIT_USAGE = 2


class QpackError(Exception):
    """Bad input or usage: a one-line message, exit code 2."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))

    @property
    def message(self) -> str:
        return str(self)
