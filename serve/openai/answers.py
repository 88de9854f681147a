"""An answer on its way to the client, the same whoever computes it: the single server's routes (engine outputs)
and the fleet (a gateway reading a worker's chunks, a worker queuing on its engine).

- `engine_refusals`: what `Engine.add` refuses, as the client sees it: a full queue is a 429 (retry later), a
  request the engine cannot take a 400.
- `sse_events`: the SSE stream of a streaming request, from `Piece`s (new text; on the last one, the finish
  reason and usage): a role chunk first (chat), text deltas, the finish reason, the usage chunk when asked
  for, then [DONE]. A stream that ends before its last piece (the client went away) calls its `abandon`, so
  the request stops consuming its engine.
The events themselves are `render`'s; this module only orders them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from serve.engine.core import QueueFull
from serve.openai import render
from serve.openai.protocol import ApiError


@contextmanager
def engine_refusals(who: str) -> Iterator[None]:
    """Around `Engine.add`: `QueueFull` becomes 429 (`{who} busy`), a `ValueError` 400 with its message."""
    try:
        yield
    except QueueFull as exc:
        raise ApiError(
            429, f"{who} busy: {exc}; retry later", code="queue_full", kind="rate_limit_error"
        ) from None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


@dataclass(frozen=True)
class Piece:
    """A step of an answer: new text, and on the last piece (`finished`) the finish reason and the usage."""

    text: str | None
    finished: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


async def sse_events(
    pieces: AsyncIterator[Piece],
    chunks: render.Chunks,
    include_usage: bool,
    abandon: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    finished = False
    try:
        if chunks.chat:
            yield chunks.role()
        async for piece in pieces:
            finished = piece.finished
            if piece.text or finished:
                yield chunks.delta(piece.text, piece.finish_reason if finished else None)
            if finished:
                if include_usage and piece.usage:
                    yield chunks.usage(piece.usage)
                break
        yield render.DONE
    finally:
        if not finished:
            await abandon()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was already read, so the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
