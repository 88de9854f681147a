"""OpenAI request bodies as plain data: parsed and validated without a server, a model or a tokenizer.

`parse_request` turns a JSON object sent to `/v1/completions` or `/v1/chat/completions` into a
`GenerationRequest`, refusing what this server does not do with a 400 that names the field: wrong types, values
out of range, and options that would change the result if ignored (n > 1, logprobs, penalties, tools...).
`sampling_params` then fits max_tokens into the context once the prompt's length is known. Errors carry the
OpenAI shape (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from serve.core.request import Owner, SamplingParams
from serve.openai.jsonbody import MAX_INT_DIGITS, BodyRejected, load
from serve.refusal import Refusal
from serve.tenancy.tenants import REQUESTED_SERVICE_TIERS, Caller

_T = TypeVar("_T")
_NO_STOPS: tuple[str, ...] = ()


def same_json(value: Any, accepted: Any) -> bool:
    """Equal as JSON values are (and as JSON Schema's `enum` compares them): a boolean is never a number, 1 and
    1.0 are the same number, and objects and arrays compare member by member."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return type(value) is type(accepted) and value == accepted
    if isinstance(value, (int, float)) and isinstance(accepted, (int, float)):
        return value == accepted
    if isinstance(value, dict) and isinstance(accepted, dict):
        return value.keys() == accepted.keys() and all(same_json(value[k], accepted[k]) for k in value)
    if isinstance(value, list) and isinstance(accepted, list):
        return len(value) == len(accepted) and all(
            same_json(a, b) for a, b in zip(value, accepted, strict=True)
        )
    return type(value) is type(accepted) and value == accepted


LARGEST_INT = 10**MAX_INT_DIGITS - 1  # the longest integer literal a body may hold (`jsonbody`)


def integral(value: Any) -> int | None:
    """An integer as JSON (and JSON Schema's `integer`) means it: 7 or 7.0, never true or 7.5; and no larger than
    the longest integer literal a body may hold (1e300 is an integer, but one no field here can use)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if abs(value) <= LARGEST_INT else None


# Options that would change the result if ignored: the values accepted (those that ask for what this server does
# anyway), and what a 400 suggests sending instead
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), " or send 1"),
    "best_of": ((None, 1), " or send 1"),
    "logprobs": ((None, False, 0), " or send false"),
    "top_logprobs": ((None, 0), " or send 0"),
    "echo": ((None, False), " or send false"),
    "suffix": ((None,), ""),
    "logit_bias": ((None, {}), " or send {}"),
    "presence_penalty": ((None, 0), " or send 0"),
    "frequency_penalty": ((None, 0), " or send 0"),
    "tools": ((None, []), " or send []"),
    "functions": ((None, []), " or send []"),
    "response_format": ((None, {"type": "text"}), ' or send {"type": "text"}'),
}
TEMPERATURE = (0.0, 2.0)
TOP_P = (1e-6, 1.0)
TOP_K = (-1, 1_000_000)  # -1 (or 0) for no top-k
PRIORITY = (-1_000_000, 1_000_000)
MAX_STOPS = 16
MAX_LABEL_CHARS = 256  # `user`, `session_id`, `cache_salt`
# `user` and `session_id`: any text but control characters and line breaks, as JSON Schema's `pattern` can say it
LABEL_PATTERN = f"^[^\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029]{{1,{MAX_LABEL_CHARS}}}$"
_LABEL = re.compile(LABEL_PATTERN[1:-1])
ROLES = ("system", "user", "assistant", "developer")
MAX_MODEL_CHARS = 256
MAX_SHOWN = 8  # bad messages named in one 400
MAX_MESSAGES = 2048  # messages in one chat request, as OpenAI's API allows


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


# A refusal's reason as HTTP states it: status and the OpenAI error type when the refusal names none.
_HTTP: dict[str, tuple[int, str]] = {
    "over_limit": (429, "rate_limit_error"),
    "overloaded": (429, "rate_limit_error"),
    "not_found": (404, "invalid_request_error"),
    "timeout": (504, "timeout"),
    "unavailable": (503, "unavailable"),
}


def http_error(error: ApiError | Refusal) -> ApiError:
    """The HTTP answer to a refusal (an ApiError is already one): its status, the caller's limits as
    x-ratelimit-* headers, Retry-After where a retry can succeed."""
    if isinstance(error, ApiError):
        return error
    status, kind = _HTTP[error.reason]
    headers = dict(error.limits)
    retry = error.retry_seconds()
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return ApiError(status, error.message, error.param, error.code, error.kind or kind, headers)


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
    def message_count(self) -> int:
        return len(self.messages) if self.messages is not None else 0

    @property
    def text_chars(self) -> int:
        """Characters of text the prompt holds (0 for token ids): what a tokenizer would be asked to read."""
        if self.messages is not None:
            return sum(len(m["content"]) for m in self.messages)
        return len(self.prompt) if isinstance(self.prompt, str) else 0


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, within `jsonbody`'s bounds (depth, integer digits, finite numbers, UTF-8);
    anything else is a 400."""
    try:
        body = load(raw)
    except BodyRejected as exc:
        raise ApiError(400, str(exc), code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"the request body must be a JSON object (got {_json_type(body)}); send {{...}}",
            code="invalid_json",
        )
    return body


def parse_request(body: dict[str, Any], chat: bool) -> GenerationRequest:
    """Every field checked and every problem reported in one 400 (the prompt's first, as a client would fix
    them)."""
    problems = _Problems()
    prompt = None if chat else problems.take(lambda: _prompt(body), None)
    messages = problems.take(lambda: _messages(body), None) if chat else None
    for key, (accepted, instead) in UNSUPPORTED.items():
        if key in body and not any(same_json(body[key], value) for value in accepted):
            problems.add(
                f"'{key}' is not supported by this server (got {_shown(body[key])}); leave it out{instead}",
                key,
                "unsupported_parameter",
            )
    problems.take(lambda: _model(body), None)
    max_key = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    if max_key != "max_tokens":
        problems.take(lambda: _max_tokens(body, "max_tokens"), None)
    top_k = problems.take(lambda: _number(body, "top_k", 0, *TOP_K, integer=True), 0)
    fields: dict[str, Any] = {
        "max_tokens": problems.take(lambda: _max_tokens(body, max_key), None),
        "temperature": problems.take(lambda: float(_number(body, "temperature", 1.0, *TEMPERATURE)), 1.0),
        "top_p": problems.take(lambda: float(_number(body, "top_p", 1.0, *TOP_P)), 1.0),
        "top_k": 0 if top_k == -1 else top_k,
        "seed": problems.take(lambda: _seed(body), None),
        "stop": problems.take(lambda: _stops(body), _NO_STOPS),
        "ignore_eos": problems.take(lambda: _flag(body, "ignore_eos"), False),
        "stream": problems.take(lambda: _flag(body, "stream"), False),
        "include_usage": problems.take(lambda: _include_usage(body), False),
        "priority": problems.take(lambda: int(_number(body, "priority", 0, *PRIORITY, integer=True)), 0),
        "cache_salt": problems.take(lambda: _cache_salt(body), None),
        "user": problems.take(lambda: _label(body, "user"), None),
        "session_id": problems.take(lambda: _label(body, "session_id"), None),
        "service_tier": problems.take(lambda: _service_tier(body), None),
    }
    problems.raise_any()
    return GenerationRequest(chat=chat, prompt=prompt, messages=messages, max_key=max_key, **fields)


class _Problems:
    """The field errors of one body, gathered so that a client fixes them all in one round."""

    def __init__(self) -> None:
        self.errors: list[ApiError] = []

    def add(self, message: str, param: str, code: str | None = None) -> None:
        self.errors.append(ApiError(400, message, param, code))

    def take(self, parse: Callable[[], _T], default: _T) -> _T:
        """What `parse` returns, or `default` with its error kept."""
        try:
            return parse()
        except ApiError as error:
            self.errors.append(error)
            return default

    def raise_any(self) -> None:
        """One 400 naming every problem (its `param` the first's)."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            first = self.errors[0]
            message = f"{len(self.errors)} problems: " + "; ".join(e.message for e in self.errors)
            raise ApiError(400, message, first.param, first.code)


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
    ids = [integral(t) for t in prompt] if isinstance(prompt, list) else []
    if ids and all(t is not None and t >= 0 for t in ids):
        return [t for t in ids if t is not None]
    raise ApiError(
        400,
        "'prompt' must be a non-empty string or a list of token ids, integers from 0 (one prompt per request)",
        "prompt",
    )


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Role and text of each message (text parts of a content list joined; 'developer' read as 'system'); every
    bad message named in one 400 (the first `MAX_SHOWN` of them)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400,
            f"'messages' must be a non-empty list of {{role, content}} objects (got {_shown(messages)})",
            "messages",
        )
    if len(messages) > MAX_MESSAGES:
        raise ApiError(
            400,
            f"'messages' holds {len(messages):,} messages; at most {MAX_MESSAGES:,} are accepted: drop or join "
            "the oldest",
            "messages",
        )
    clean, problems = [], []
    for index, message in enumerate(messages):
        try:
            clean.append(_message(message, f"messages[{index}]"))
        except ApiError as error:
            problems.append(error.message)
    if problems:
        more = f" (and {len(problems) - MAX_SHOWN} more)" if len(problems) > MAX_SHOWN else ""
        raise ApiError(400, "; ".join(problems[:MAX_SHOWN]) + more, "messages")
    return clean


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(
            400, f"{where} must be an object with a 'role' string (got {_shown(message)})", "messages"
        )
    if message["role"] not in ROLES:
        raise ApiError(
            400,
            f"{where}.role {_shown(message['role'])} is not supported; use one of {', '.join(ROLES)}",
            "messages",
        )
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{index}]") for index, part in enumerate(content))
    if not isinstance(content, str):
        raise ApiError(
            400,
            f"{where}.content must be a string or a list of text parts (got {_shown(content)})",
            "messages",
        )
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": _text(content, f"{where}.content", "messages")}


def _text_part(part: Any, where: str) -> str:
    """The text of one content part ('' for a part of another type, e.g. an image, which is not read)."""
    if not isinstance(part, dict):
        raise ApiError(400, f'{where} must be an object like {{"type": "text", "text": "..."}}', "messages")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise ApiError(400, f'{where}.type must be a string such as "text" (got {_shown(kind)})', "messages")
    if kind != "text":
        return ""
    text = part.get("text")
    if not isinstance(text, str):
        raise ApiError(400, f"{where}.text must be a string (got {_shown(text)})", "messages")
    return text


def _number(
    body: dict[str, Any], key: str, default: float, low: float, high: float, integer: bool = False
) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    value = integral(value) if integer and integral(value) is not None else value
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{key}' must be {kind} (got {_shown(value)})", key)
    if not low <= value <= high:
        raise ApiError(400, f"'{key}' must be between {low} and {high} (got {value})", key)
    return value


def _max_tokens(body: dict[str, Any], max_key: str) -> int | None:
    raw = body.get(max_key)
    if raw is None:
        return None
    tokens = integral(raw)
    if tokens is None:
        raise ApiError(400, f"'{max_key}' must be an integer (got {_shown(raw)})", max_key)
    if tokens <= 0:
        raise ApiError(400, f"'{max_key}' must be at least 1 (got {tokens})", max_key)
    return tokens


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (_text(stop, "stop", "stop"),) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        return tuple(_text(s, "stop", "stop") for s in stop if s)
    raise ApiError(
        400, f"'stop' must be a string or a list of up to {MAX_STOPS} strings (got {_shown(stop)})", "stop"
    )


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
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise ApiError(
            400,
            f"'{key}' must be a string of 1 to {MAX_LABEL_CHARS} characters without control characters or line "
            f"breaks (got {_shown(value)})",
            key,
        )
    return _text(value, key, key)


def _service_tier(body: dict[str, Any]) -> str | None:
    """OpenAI's `service_tier`: a wish the server grants only downwards (`serve.tenancy`)."""
    tier = body.get("service_tier")
    if tier is None:
        return None
    if tier not in REQUESTED_SERVICE_TIERS:
        choices = ", ".join(REQUESTED_SERVICE_TIERS)
        raise ApiError(400, f"'service_tier' must be one of {choices} (got {_shown(tier)})", "service_tier")
    return str(tier)


def _cache_salt(body: dict[str, Any]) -> str | None:
    """The optional `cache_salt` extension (as in vLLM): requests share prefix-cache blocks only with requests of
    the same salt, so a tenant cannot reuse or probe another tenant's cached prompts."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_LABEL_CHARS:
        raise ApiError(
            400,
            f"'cache_salt' must be a non-empty string of at most {MAX_LABEL_CHARS} characters",
            "cache_salt",
        )
    return _text(salt, "cache_salt", "cache_salt")


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and integral(seed) is None:
        raise ApiError(400, f"'seed' must be an integer (got {_shown(seed)})", "seed")
    return integral(seed)


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        raise ApiError(
            400,
            f"'model' must be a string of at most {MAX_MODEL_CHARS} characters (got {_shown(model)})",
            "model",
        )
    return model


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean, true or false (got {_shown(value)})", key)
    return bool(value)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object (got {_shown(options)})", "stream_options")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(
            400, f"'stream_options.include_usage' must be a boolean (got {_shown(usage)})", "stream_options"
        )
    return bool(usage)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """A client's value as an error message may quote it: short, one line, its type when it is a container."""
    if isinstance(value, (dict, list)) or value is None:
        return _json_type(value)
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def limited_params(
    request: GenerationRequest, prompt_tokens: int, max_model_len: int, caller: Caller
) -> SamplingParams:
    """Sampling parameters within the caller's limits: `max_tokens` at most its tenant's `max_tokens` (400
    above it), and a request that names none gets no more than fits its `tokens_per_minute` with its prompt."""
    params = sampling_params(request, prompt_tokens, max_model_len, caller.max_tokens)
    if request.max_tokens is None and caller.tokens_per_minute is not None:
        fits = int(caller.tokens_per_minute) - prompt_tokens
        if 1 <= fits < params.max_tokens:
            params = params.replace(max_tokens=fits)
    return params


def owner_of(caller: Caller, request: GenerationRequest) -> Owner:
    """The engine's owner of a request: the caller's tenant and tier, and the names the body gave inside it."""
    return Owner(
        caller.tenant,
        caller.tier,
        caller.tier_rank,
        request.user,
        request.session_id,
        caller.session_ttl,
        caller.weight,
        caller.max_sessions,
    )
