"""OpenAI request bodies as plain data: parsed and validated without a server, a model or a tokenizer.

`parse_request` turns a JSON object sent to `/v1/completions` or `/v1/chat/completions` into a
`GenerationRequest`, refusing what this server does not do with a 400 that names the field: wrong types, values
out of range, and options that would change the result if ignored (n > 1, logprobs, penalties, tools...).
`sampling_params` then fits max_tokens into the context once the prompt's length is known. Errors carry the
OpenAI shape (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve.request import SamplingParams
from serve.tenancy.tenants import REQUESTED_SERVICE_TIERS

UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: v not in (None, False),
    "suffix": lambda v: v is not None,
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "response_format": lambda v: v not in (None, {"type": "text"}),
}
ROLES = ("system", "user", "assistant", "developer")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})  # e.g. Retry-After and the x-ratelimit-* headers of a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request; `prompt` (completions) or `messages` (chat) is set."""

    chat: bool
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_key: str  # the field max_tokens came from, for error messages
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None = None
    user: str | None = None
    session_id: str | None = None
    service_tier: str | None = None  # asked for; the tier it runs at is its tenant's or a lower one

    @property
    def text_chars(self) -> int:
        """Characters of text the prompt holds (0 for token ids): what a tokenizer would be asked to read."""
        if self.messages is not None:
            return sum(len(m["content"]) for m in self.messages)
        return len(self.prompt) if isinstance(self.prompt, str) else 0


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse_request(body: dict[str, Any], chat: bool) -> GenerationRequest:
    """Every field checked, in the order a client would fix them: the prompt, then the options."""
    prompt = None if chat else _prompt(body)
    messages = _messages(body) if chat else None
    for key, bad in UNSUPPORTED.items():
        if key in body and bad(body[key]):
            raise ApiError(400, f"'{key}' is not supported by this server", key, "unsupported_parameter")
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    top_k = _number(body, "top_k", 0, -1, 1_000_000, integer=True)
    return GenerationRequest(
        chat=chat,
        prompt=prompt,
        messages=messages,
        max_key=max_key,
        max_tokens=_max_tokens(body, max_key),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        top_k=0 if top_k == -1 else top_k,
        seed=_seed(body),
        stop=_stops(body),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        priority=int(_number(body, "priority", 0, -1_000_000, 1_000_000, integer=True)),
        cache_salt=_cache_salt(body),
        user=_label(body, "user"),
        session_id=_label(body, "session_id"),
        service_tier=_service_tier(body),
    )


def sampling_params(
    request: GenerationRequest, prompt_len: int, max_model_len: int, max_tokens_limit: int | None = None
) -> SamplingParams:
    """The engine's sampling parameters; max_tokens must leave the prompt room in the context (default: 16 for
    completions, the rest of the context for chat) and stay within `max_tokens_limit` (the caller's tenant's
    limit, also the most a request that asks none gets)."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt is {prompt_len} tokens, longer than the model context of {max_model_len}; shorten it",
            "messages" if request.chat else "prompt",
            "context_length_exceeded",
        )
    if request.max_tokens is None:
        max_tokens = min(room if request.chat else 16, room, max_tokens_limit or room)
    elif max_tokens_limit is not None and request.max_tokens > max_tokens_limit:
        raise ApiError(
            400,
            f"'{request.max_key}' {request.max_tokens} is above this API key's limit of {max_tokens_limit}",
            request.max_key,
            "max_tokens_above_limit",
        )
    elif request.max_tokens > room:
        raise ApiError(
            400,
            f"'{request.max_key}' {request.max_tokens} is too large: prompt ({prompt_len} tokens) + "
            f"{request.max_key} must fit the context of {max_model_len} tokens (at most {room})",
            request.max_key,
            "context_length_exceeded",
        )
    else:
        max_tokens = request.max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
    )


def _text(value: str, field: str, param: str) -> str:
    """`value` if it is valid Unicode; JSON can carry a lone UTF-16 surrogate (\\ud800) that no tokenizer
    accepts: refused with a 400 naming the field, never passed on."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"'{field}' holds an unpaired UTF-16 surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}); "
            "send valid Unicode text",
            param,
            "invalid_text",
        ) from None
    return value


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        return _text(prompt, "prompt", "prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise ApiError(
        400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt"
    )


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Role and text of each message (text parts of a content list joined; 'developer' read as 'system')."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{index}].content must be a string", "messages")
        if message["role"] not in ROLES:
            raise ApiError(400, f"messages[{index}].role {message['role']!r} is not supported", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        clean.append({"role": role, "content": _text(content, f"messages[{index}].content", "messages")})
    return clean


def _number(
    body: dict[str, Any], key: str, default: float, low: float, high: float, integer: bool = False
) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if not low <= value <= high:
        raise ApiError(400, f"'{key}' must be between {low} and {high} (got {value})", key)
    return value


def _max_tokens(body: dict[str, Any], max_key: str) -> int | None:
    raw = body.get(max_key, body.get("max_tokens"))
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ApiError(400, f"'{max_key}' must be an integer", max_key)
    if raw <= 0:
        raise ApiError(400, f"'{max_key}' must be at least 1 (got {raw})", max_key)
    return raw


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (_text(stop, "stop", "stop"),) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return tuple(_text(s, "stop", "stop") for s in stop if s)
    raise ApiError(400, "'stop' must be a string or a list of up to 16 strings", "stop")


def session_label(user: str | None, session_id: str | None) -> tuple[str | None, str | None]:
    """The user and session a deletion names (query parameters), checked as the body's `user` and `session_id`
    are; deleting every session of a user needs the user."""
    if session_id is None and not user:
        raise ApiError(400, "name the user whose sessions to delete: ?user=NAME", "user")
    return _label({"user": user}, "user"), _label({"session_id": session_id}, "session_id")


def _label(body: dict[str, Any], key: str) -> str | None:
    """OpenAI's `user` and the `session_id` extension: short printable names the tiers record blocks under."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 256 or not value.isprintable():
        raise ApiError(400, f"'{key}' must be a printable string of 1 to 256 characters", key)
    return _text(value, key, key)


def _service_tier(body: dict[str, Any]) -> str | None:
    """OpenAI's `service_tier`: a wish the server grants only downwards (`serve.tenancy`)."""
    tier = body.get("service_tier")
    if tier is None:
        return None
    if tier not in REQUESTED_SERVICE_TIERS:
        choices = ", ".join(REQUESTED_SERVICE_TIERS)
        raise ApiError(400, f"'service_tier' must be one of {choices} (got {tier!r})", "service_tier")
    return str(tier)


def _cache_salt(body: dict[str, Any]) -> str | None:
    """The optional `cache_salt` extension (as in vLLM): requests share prefix-cache blocks only with requests of
    the same salt, so a tenant cannot reuse or probe another tenant's cached prompts."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > 256:
        raise ApiError(400, "'cache_salt' must be a non-empty string of at most 256 characters", "cache_salt")
    return _text(salt, "cache_salt", "cache_salt")


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "'seed' must be an integer", "seed")
    return seed
