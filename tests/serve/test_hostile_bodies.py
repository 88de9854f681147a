"""Malformed and hostile request bodies, at the single server and at the fleet gateway: each is a 400 that names
what is wrong, never a 5xx or a dropped connection, and at the gateway a body it cannot parse is never counted as
a Redis error (it is refused before Redis is asked)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from serve.fleet.gateway import Gateway, GatewayConfig, create_gateway_app
from serve.http import BackgroundServer, free_port
from serve.openai import ServerInfo
from serve.openai.jsonbody import MAX_INT_DIGITS, MAX_JSON_DEPTH
from serve.openai.protocol import ApiError, parse_json, parse_request
from tests.serve.test_api import make_engine

DEEP = b'{"prompt": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
UNCLOSED = b'{"prompt": "x", "deep": ' + b"[" * 100_000
HUGE_INT = b'{"prompt": "x", "max_tokens": 1' + b"0" * 4_999 + b"}"
HUGE_INT_ANYWHERE = b'{"prompt": "x", "metadata": {"a": [-' + b"9" * 5_000 + b"]}}"


def _chat(*messages: object, **extra: object) -> bytes:
    return json.dumps({"messages": list(messages), **extra}).encode()


def _completion(**fields: object) -> bytes:
    return json.dumps({"prompt": "hello", **fields}).encode()


# (endpoint, body, what the message says); every one must be a 400
HOSTILE: list[tuple[str, bytes, str]] = [
    (
        "chat",
        _chat({"role": "user", "content": [{"type": "text", "text": 5}]}),
        "messages[0].content[0].text",
    ),
    ("chat", _chat({"role": "user", "content": [{"type": "text", "text": None}]}), "content[0].text"),
    ("chat", _chat({"role": "user", "content": [{"type": "text", "text": ["a"]}]}), "content[0].text"),
    ("chat", _chat({"role": "user", "content": [7]}), "messages[0].content[0] must be an object"),
    ("chat", _chat({"role": "user", "content": [{"type": 3, "text": "a"}]}), "content[0].type"),
    ("chat", _chat({"role": "user", "content": {"text": "a"}}), "messages[0].content"),
    ("chat", _chat({"role": ["user"], "content": "a"}), "messages[0]"),
    ("chat", _chat("hello"), "messages[0]"),
    ("chat", json.dumps({"messages": {"role": "user"}}).encode(), "'messages'"),
    ("completions", HUGE_INT, f"more than {MAX_INT_DIGITS} digits"),
    ("completions", HUGE_INT_ANYWHERE, f"more than {MAX_INT_DIGITS} digits"),
    ("chat", _chat({"role": "user", "content": "a"})[:-1] + b', "n": ' + b"1" * 5_000 + b"}", "digits"),
    ("completions", DEEP, f"deeper than {MAX_JSON_DEPTH}"),
    ("completions", UNCLOSED, f"deeper than {MAX_JSON_DEPTH}"),
    ("chat", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", f"deeper than {MAX_JSON_DEPTH}"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', "NaN"),
    ("completions", b'{"prompt": "x", "top_p": -Infinity}', "-Infinity"),
    ("completions", b'{"prompt": "x", "temperature": 1e999}', "1e999"),
    ("completions", b'{"prompt": "\xff\xfe"}', "UTF-8"),
    ("completions", b"[1, 2]", "JSON object"),
    ("completions", b'"prompt"', "JSON object"),
    ("completions", b"null", "JSON object"),
    ("completions", b"", "malformed JSON"),
    ("completions", b'{"prompt": "x",}', "malformed JSON"),
    ("completions", _completion(model=["tiny"]), "'model' must be a string"),
    ("completions", _completion(model={"id": "tiny"}), "'model' must be a string"),
    ("completions", _completion(model="m" * 5_000), "'model' must be a string of at most"),
    ("completions", _completion(max_tokens=True), "'max_tokens' must be an integer"),
    ("completions", _completion(max_tokens=2.5), "'max_tokens' must be an integer"),
    ("completions", _completion(max_tokens=-3), "'max_tokens' must be at least 1"),
    ("chat", _chat({"role": "user", "content": "a"}, max_completion_tokens="9"), "'max_completion_tokens'"),
    ("completions", _completion(stop={"a": 1}), "'stop'"),
    ("completions", _completion(stop=["a", 3]), "'stop'"),
    ("completions", _completion(logit_bias={"5": 10}), "'logit_bias'"),
    ("completions", _completion(logit_bias="yes"), "'logit_bias'"),
    ("completions", _completion(n="2"), "'n'"),
    ("completions", _completion(n=True), "'n'"),
    ("chat", _chat({"role": "user", "content": "a"}, tools=[{"type": "function"}]), "'tools'"),
    ("completions", _completion(service_tier=["auto"]), "'service_tier'"),
    ("completions", _completion(service_tier={"tier": "auto"}), "'service_tier'"),
    ("completions", _completion(user=5), "'user'"),
    ("completions", _completion(user="u" * 300), "'user'"),
    ("completions", _completion(session_id=["s"]), "'session_id'"),
    ("completions", _completion(session_id=""), "'session_id'"),
    ("completions", _completion(ignore_eos="no"), "'ignore_eos' must be a boolean"),
    ("completions", _completion(stream=1), "'stream' must be a boolean"),
    ("completions", _completion(stream_options={"include_usage": "yes"}), "'stream_options.include_usage'"),
    ("completions", _completion(stream_options=[1]), "'stream_options' must be an object"),
    ("completions", _completion(seed=1.5), "'seed' must be an integer"),
    ("completions", _completion(priority="high"), "'priority'"),
    ("completions", _completion(cache_salt=7), "'cache_salt'"),
    ("completions", _completion(top_k=2.5), "'top_k'"),
    ("completions", _completion(temperature="0"), "'temperature'"),
    ("completions", _completion(prompt=[[1, 2]]), "'prompt'"),
    ("completions", _completion(prompt={"text": "x"}), "'prompt'"),
]


def _post(client: httpx.Client | TestClient, endpoint: str, body: bytes) -> Any:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[httpx.Client]:
    engine = make_engine(tiny_llama)
    with (
        BackgroundServer(engine, ServerInfo(name="tiny", version="3")) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[TestClient, Gateway]]:
    """A gateway whose Redis is down: what it refuses before asking Redis must be refused as the client's fault."""
    fleet = Gateway(GatewayConfig(f"redis://127.0.0.1:{free_port()}/0", request_timeout=5.0))
    yield TestClient(create_gateway_app(fleet), raise_server_exceptions=False), fleet


@pytest.mark.parametrize(("endpoint", "body", "fragment"), HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_a_hostile_body_is_a_400_at_the_server(
    server: httpx.Client, endpoint: str, body: bytes, fragment: str
) -> None:
    response = _post(server, endpoint, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"]


@pytest.mark.parametrize(("endpoint", "body", "fragment"), HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_a_hostile_body_is_a_400_at_the_gateway_and_no_redis_error(
    gateway: tuple[TestClient, Gateway], endpoint: str, body: bytes, fragment: str
) -> None:
    client, fleet = gateway
    redis_errors, refused = _redis_errors(fleet), _count(fleet, 'qpack_fleet_requests_total{outcome="400"}')
    response = _post(client, endpoint, body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]
    assert _redis_errors(fleet) == redis_errors
    assert _count(fleet, 'qpack_fleet_requests_total{outcome="400"}') == refused + 1


def _count(fleet: Gateway, sample: str) -> float:
    for line in generate_latest(fleet.metrics.registry).decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _redis_errors(fleet: Gateway) -> float:
    return _count(fleet, "qpack_fleet_redis_errors_total")


def test_a_content_length_of_thousands_of_digits_is_a_413(gateway: tuple[TestClient, Gateway]) -> None:
    client, _fleet = gateway
    headers = {"content-length": "1" + "0" * 5_000, "content-type": "application/json"}
    response = client.post("/v1/completions", content=b'{"prompt": "x"}', headers=headers)
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]


def test_the_server_still_answers_after_the_hostile_bodies(server: httpx.Client) -> None:
    answer = server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200 and server.get("/health").status_code == 200


def test_a_valid_body_at_a_gateway_without_redis_is_still_a_redis_503(
    gateway: tuple[TestClient, Gateway],
) -> None:
    client, fleet = gateway
    response = _post(client, "completions", _completion(max_tokens=2))
    assert response.status_code == 503 and "Redis" in response.json()["error"]["message"]
    assert _redis_errors(fleet) >= 1


# ---------------------------------------------------------------------------------------------- the parser alone


def test_nesting_up_to_the_limit_parses_and_one_more_is_refused() -> None:
    def nested(depth: int) -> bytes:  # the body object itself is the first level
        return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    assert parse_json(nested(MAX_JSON_DEPTH))["a"] is not None
    with pytest.raises(ApiError, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse_json(nested(MAX_JSON_DEPTH + 1))


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = '["\\"' + "[" * 1000 + '", "{{{"]'
    body = parse_json(json.dumps({"prompt": text, "stop": ["]]]\\"]}).encode())
    assert body["prompt"] == text


def test_integers_up_to_the_bound_parse_and_the_error_says_where() -> None:
    assert parse_json(b'{"seed": -' + b"9" * MAX_INT_DIGITS + b"}")["seed"] < 0
    with pytest.raises(ApiError) as caught:
        parse_json(b'{"seed": ' + b"9" * (MAX_INT_DIGITS + 1) + b"}")
    assert caught.value.status == 400 and "at byte 9" in caught.value.message


def test_every_offending_field_is_named_at_once() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}],
        "temperature": "hot",
        "stop": 5,
        "user": 3,
        "n": 4,
    }
    with pytest.raises(ApiError) as caught:
        parse_request(body, chat=True)
    message = caught.value.message
    for name in ("messages[0].content[0].text", "'temperature'", "'stop'", "'user'", "'n'"):
        assert name in message, message
    assert caught.value.param == "messages" and "5 problems" in message and "\n" not in message
