"""OpenAI response bodies and server-sent-event chunks for completions and chat completions."""

from __future__ import annotations

import json
from typing import Any

from serve.engine.output import RequestOutput

DONE = "data: [DONE]\n\n"


def usage(output: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "total_tokens": output.prompt_tokens + output.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }


def response(
    request_id: str,
    chat: bool,
    created: int,
    model: str,
    text: str,
    final: RequestOutput,
    service_tier: str,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The whole answer of a non-streaming request (`service_tier`: the tier it ran at, as OpenAI names it;
    `fingerprint`: the variant that computed it)."""
    choice: dict[str, Any]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = final.finish_reason
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "service_tier": service_tier,
        "system_fingerprint": fingerprint,
        "choices": [choice],
        "usage": usage(final),
    }


class Chunks:
    """The SSE events of one streaming request: a role chunk first (chat), text deltas, the finish reason, the
    usage chunk when asked for, then [DONE]."""

    def __init__(
        self,
        request_id: str,
        chat: bool,
        created: int,
        model: str,
        service_tier: str,
        fingerprint: str | None = None,
    ) -> None:
        self.request_id, self.chat, self.created, self.model = request_id, chat, created, model
        self.service_tier, self.fingerprint = service_tier, fingerprint
        self.kind = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, **fields: Any) -> str:
        body = {
            "id": self.request_id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "service_tier": self.service_tier,
            "system_fingerprint": self.fingerprint,
        }
        return f"data: {json.dumps({**body, **fields})}\n\n"

    def role(self) -> str:
        return self._event(choices=[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])

    def delta(self, text: str | None, finish_reason: str | None) -> str:
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._event(choices=[choice])

    def usage(self, counts: dict[str, Any]) -> str:
        return self._event(choices=[], usage=counts)
