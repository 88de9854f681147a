"""Why a request is turned away, said once for every front end: the engine's neighbours (tenancy's limits, the
surge controller, the variants a server holds) refuse with a `Refusal`, which names the reason, not a protocol's
status code. The OpenAI front end (`serve.openai`) maps it onto HTTP (`http_error`: 429, 503, 404, 504), the fleet's
gateway onto its own answers; nothing below the front ends imports HTTP.
"""

from __future__ import annotations

import math
from typing import Literal

Reason = Literal["over_limit", "overloaded", "not_found", "timeout", "unavailable"]
REASONS: tuple[Reason, ...] = ("over_limit", "overloaded", "not_found", "timeout", "unavailable")


class Refusal(Exception):
    """A request refused: `reason` (over_limit: the caller's own limits; overloaded: the server's capacity;
    not_found; timeout; unavailable: a dependency is down), a message for the caller, the field at fault
    (`param`), a machine-readable `code` and error `kind`, when to retry (seconds; inf: never as asked), and
    `limits`: the caller's limit state by OpenAI's rate-limit names (x-ratelimit-*), which a front end may pass on."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        retry_after: float | None = None,
        limits: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        assert reason in REASONS, reason
        self.reason, self.message, self.param, self.code, self.kind = reason, message, param, code, kind
        self.retry_after = retry_after
        self.limits = dict(limits or {})

    def retry_seconds(self) -> int | None:
        """Whole seconds to wait before retrying (at least 1); None when not stated or when retrying the same
        request can never succeed."""
        if self.retry_after is None or math.isinf(self.retry_after):
            return None
        return max(1, math.ceil(self.retry_after))
