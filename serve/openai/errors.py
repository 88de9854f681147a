"""Errors as OpenAI's clients read them: the `{"error": {...}}` body, with the headers an error carries."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from serve.openai.protocol import ApiError, http_error
from serve.refusal import Refusal

_log = logging.getLogger("qpack.serve")


def error_response(refused: ApiError | Refusal) -> JSONResponse:
    """The OpenAI error body (a refusal as HTTP states it); a 429 or 503 without headers of its own says
    Retry-After: 1."""
    error = http_error(refused)
    headers = dict(error.headers)
    if error.status in (429, 503) and not headers:
        headers["Retry-After"] = "1"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def session_not_found(user: str | None, session_id: str | None) -> ApiError:
    """The 404 of a deletion that found nothing: the same words whether the session never existed or is another
    tenant's."""
    what = (
        "session"
        + (f" {session_id!r}" if session_id is not None else "s")
        + (f" of user {user!r}" if user else "")
    )
    return ApiError(404, f"no stored {what} for this API key", "session_id", "session_not_found")


async def internal_error(_request: Request, error: Exception) -> Response:
    """A bug, never the client's input: logged with its traceback, answered in the OpenAI error shape."""
    if isinstance(error, ApiError | Refusal):
        return error_response(error)
    _log.error("request failed", exc_info=error)
    body = ApiError(500, "internal server error; see the server log", kind="server_error").body()
    return Response(json.dumps(body), status_code=500, media_type="application/json")
