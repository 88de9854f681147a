"""The OpenAPI description of what the routes accept and answer, derived from the limits `protocol` enforces.

The routes read their bodies themselves (`protocol.parse_request`: bounded JSON, every problem in one 400 of
OpenAI's shape), so FastAPI cannot infer a schema from them. Without one, `/openapi.json` would say "any body",
and a client generator or a schema fuzzer (schemathesis, run in `tests/serve/test_schema.py`) would learn
nothing. This module writes the schema from the same constants the parser checks, so that a body is valid here
exactly when the parser takes it; what no static schema can say (a prompt's length in tokens against the model's
context, a tenant's `max_tokens` limit, rate limits) is a documented 400 or 429 with its own `code`.
"""

from __future__ import annotations

from typing import Any

from serve.openai.protocol import (
    LABEL_PATTERN,
    LARGEST_INT,
    MAX_LABEL_CHARS,
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_STOPS,
    PRIORITY,
    ROLES,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    UNSUPPORTED,
)
from serve.tenancy.tenants import REQUESTED_SERVICE_TIERS

SECURITY_SCHEME = "apiKey"  # `Authorization: Bearer KEY`

# Statuses every generation route may answer with, besides 200: what each means to a client
ERRORS = {
    "400": "a malformed body, a field out of range, or a prompt that cannot fit the model's context",
    "401": "no API key, or one this server does not know",
    "404": "a model this server does not serve",
    "413": "a body larger than --max-request-bytes",
    "429": "the tenant's request, token or concurrency limit (Retry-After and x-ratelimit-* headers say when)",
    "503": "the server is over capacity for this tier, or draining",
    "504": "the request ran past the server's request timeout",
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(low: float, high: float, description: str) -> dict[str, Any]:
    return _nullable({"type": "number", "minimum": low, "maximum": high, "description": description})


def _integer(low: int, high: int, description: str) -> dict[str, Any]:
    return _nullable({"type": "integer", "minimum": low, "maximum": high, "description": description})


def _label(description: str) -> dict[str, Any]:
    return _nullable({"type": "string", "pattern": LABEL_PATTERN, "description": description})


def _common(max_model_len: int | None, models: list[str] | None) -> dict[str, Any]:
    """The fields both generation routes read."""
    most_tokens = max_model_len if max_model_len is not None else LARGEST_INT
    model: dict[str, Any] = {"type": "string", "maxLength": MAX_MODEL_CHARS}
    if models is not None:
        model["enum"] = models
    properties: dict[str, Any] = {
        "model": _nullable({**model, "description": "the model, or one of its variants to pin it"}),
        "max_tokens": _integer(
            1, most_tokens, "tokens to generate; prompt + max_tokens must fit the context"
        ),
        "temperature": _number(*TEMPERATURE, "0 (or under 1e-5) is greedy"),
        "top_p": _number(*TOP_P, "nucleus sampling"),
        "top_k": _integer(*TOP_K, "-1 or 0: no top-k"),
        "seed": _integer(-LARGEST_INT, LARGEST_INT, "a sampled request's random stream"),
        "stop": _nullable(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS},
                ]
            }
        ),
        "ignore_eos": _nullable({"type": "boolean"}),
        "stream": _nullable({"type": "boolean", "description": "answer as server-sent events"}),
        "stream_options": _nullable(
            {"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}}
        ),
        "priority": _integer(*PRIORITY, "orders only the caller's own requests; lower runs first"),
        "cache_salt": _nullable(
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_LABEL_CHARS,
                "description": "requests share prefix-cache blocks only with requests of the same salt",
            }
        ),
        "user": _label("the end user, whose session KV may be kept between requests"),
        "session_id": _label("the user's session, whose KV may be kept between requests"),
        "service_tier": _nullable(
            {
                "type": "string",
                "enum": list(REQUESTED_SERVICE_TIERS),
                "description": "granted only downwards from the tenant's tier",
            }
        ),
    }
    for key, (accepted, _) in UNSUPPORTED.items():
        properties[key] = {
            "enum": list(accepted),
            "description": "not supported: only these values are accepted",
        }
    return properties


def _prompt(vocab_size: int | None) -> dict[str, Any]:
    token: dict[str, Any] = {"type": "integer", "minimum": 0}
    token["maximum"] = vocab_size - 1 if vocab_size is not None else LARGEST_INT
    return {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": token, "minItems": 1},
        ],
        "description": "one prompt: text, or token ids",
    }


_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_OTHER_PART = {
    "type": "object",
    "properties": {"type": {"type": "string", "not": {"const": "text"}}},
    "required": ["type"],
    "description": "a part of another kind (an image...): not read",
}
MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _OTHER_PART]}}]
        },
    },
    "required": ["role", "content"],
}


def completion_body(
    vocab_size: int | None = None, max_model_len: int | None = None, models: list[str] | None = None
) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"prompt": _prompt(vocab_size), **_common(max_model_len, models)},
        "required": ["prompt"],
    }


def chat_body(max_model_len: int | None = None, models: list[str] | None = None) -> dict[str, Any]:
    properties = _common(max_model_len, models)
    properties["max_completion_tokens"] = properties["max_tokens"]
    messages = {"type": "array", "items": MESSAGE, "minItems": 1, "maxItems": MAX_MESSAGES}
    return {"type": "object", "properties": {"messages": messages, **properties}, "required": ["messages"]}


ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    return {
        s: {"description": d, "content": {"application/json": {"schema": ERROR}}} for s, d in statuses.items()
    }


def _answer(chat: bool) -> dict[str, Any]:
    choice = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "finish_reason": {"type": ["string", "null"]},
            **({"message": {"type": "object"}} if chat else {"text": {"type": "string"}}),
        },
        "required": ["index", "finish_reason", "message" if chat else "text"],
    }
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"type": "object"},
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    }


# One server-sent event: `data` holds a JSON chunk (the answer's shape, `choices[].delta` or `.text`), an
# error object, or `[DONE]`
EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


def generation(
    chat: bool,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    models: list[str] | None = None,
) -> dict[str, Any]:
    """The OpenAPI operation fields (FastAPI's `openapi_extra`) of `/v1/chat/completions` or `/v1/completions`:
    a server knows its vocabulary, context and model names; a fleet's gateway, whose workers come and go, does
    not (a name no worker serves is then a 404)."""
    body = chat_body(max_model_len, models) if chat else completion_body(vocab_size, max_model_len, models)
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {
                "description": "the completion; with `stream: true`, server-sent events ending in `data: [DONE]`",
                "content": {
                    "application/json": {"schema": _answer(chat)},
                    "text/event-stream": {"schema": EVENT},
                },
            },
            **_errors(ERRORS),
        },
        "security": [{SECURITY_SCHEME: []}],
    }


def _sessions_answer(one: bool) -> dict[str, Any]:
    properties = {
        "object": {"type": "string"},
        "user": {"type": ["string", "null"]},
        "blocks": {"type": "integer"},
    }
    if one:
        properties["id"] = {"type": "string"}
    schema = {"type": "object", "properties": properties, "required": ["object"]}
    return {"content": {"application/json": {"schema": schema}}}


def sessions(one: bool) -> dict[str, Any]:
    """The operation fields of `DELETE /v1/sessions/{session_id}` (one) or `DELETE /v1/sessions` (a user's)."""
    user = {"type": "string", "pattern": LABEL_PATTERN}
    parameters: list[dict[str, Any]] = [
        {
            "name": "user",
            "in": "query",
            "required": not one,
            "schema": user,
            "description": "the session's user",
        }
    ]
    if one:
        parameters.insert(0, {"name": "session_id", "in": "path", "required": True, "schema": user})
    return {
        "parameters": parameters,
        "responses": {
            "200": {"description": "deleted: the KV blocks freed", **_sessions_answer(one)},
            "202": {
                "description": "a fleet: kept until every worker has applied it",
                **_sessions_answer(one),
            },
            **_errors(
                {
                    "400": "a user or session name out of bounds",
                    "401": ERRORS["401"],
                    "404": "no such session for this tenant",
                    "429": ERRORS["429"],
                    "503": "the fleet cannot record the deletion",
                }
            ),
        },
        "security": [{SECURITY_SCHEME: []}],
    }


def models() -> dict[str, Any]:
    listing = {
        "type": "object",
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}},
        "required": ["object", "data"],
    }
    return {
        "responses": {
            "200": {
                "description": "the served model and its variants",
                "content": {"application/json": {"schema": listing}},
            },
            **_errors({"401": ERRORS["401"]}),
        },
        "security": [{SECURITY_SCHEME: []}],
    }


def add_security(openapi: dict[str, Any]) -> dict[str, Any]:
    """The bearer scheme the operations above name."""
    schemes = openapi.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[SECURITY_SCHEME] = {"type": "http", "scheme": "bearer", "description": "an API key of a tenant"}
    return openapi


def health() -> dict[str, Any]:
    state = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}
    content = {"application/json": {"schema": state}}
    return {
        "responses": {
            "200": {"description": "serving", "content": content},
            "503": {"description": "draining, or (a gateway) no workers or no Redis", "content": content},
        }
    }


def metrics() -> dict[str, Any]:
    return {
        "responses": {
            "200": {
                "description": "Prometheus metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **_errors({"401": "the server has a metrics key and this is not it"}),
        }
    }
