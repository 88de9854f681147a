"""Request parsing and validation of the OpenAI API as plain functions: no server, no model, no tokenizer."""

from __future__ import annotations

import pytest

from serve.openai.protocol import ApiError, http_error, parse_json, parse_request, sampling_params
from serve.refusal import REASONS, Refusal
from serve.variants import Served, Variants


def test_a_completion_request_parses_every_option() -> None:
    body = {
        "prompt": ["Hello"],
        "max_tokens": 7,
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": -1,
        "seed": 11,
        "stop": ["\n", ""],
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": -2,
    }
    request = parse_request(body, chat=False)
    assert request.prompt == "Hello" and request.messages is None and request.max_tokens == 7
    assert (request.temperature, request.top_p, request.top_k, request.seed) == (0.3, 0.9, 0, 11)
    assert request.stop == ("\n",) and request.ignore_eos and request.stream and request.include_usage
    params = sampling_params(request, prompt_len=10, max_model_len=100)
    assert params.max_tokens == 7 and params.seed == 11 and params.stop == ("\n",)


def test_chat_messages_are_cleaned_and_default_to_the_rest_of_the_context() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url"},
                    {"type": "text", "text": "b"},
                ],
            },
        ],
        "max_completion_tokens": 5,
    }
    request = parse_request(body, chat=True)
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert request.max_key == "max_completion_tokens" and request.max_tokens == 5
    no_limit = parse_request({"messages": body["messages"]}, chat=True)
    assert sampling_params(no_limit, prompt_len=30, max_model_len=100).max_tokens == 70
    assert sampling_params(parse_request({"prompt": "x"}, chat=False), 30, 100).max_tokens == 16


@pytest.mark.parametrize(
    ("body", "chat", "param", "fragment"),
    [
        ({"prompt": ""}, False, "prompt", "must not be empty"),
        ({"prompt": [1, True]}, False, "prompt", "non-empty string or a list of token ids"),
        ({"messages": []}, True, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, True, "messages", "role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, True, "messages", "content must be a string"),
        ({"prompt": "x", "n": 2}, False, "n", "not supported"),
        ({"prompt": "x", "max_tokens": True}, False, "max_tokens", "must be an integer"),
        ({"prompt": "x", "temperature": 2.5}, False, "temperature", "between 0.0 and 2.0"),
        ({"prompt": "x", "stop": ["a"] * 17}, False, "stop", "up to 16 strings"),
        ({"prompt": "x", "seed": "7"}, False, "seed", "must be an integer"),
        ({"prompt": "x", "stream_options": "yes"}, False, "stream_options", "must be an object"),
        ({"prompt": "x", "priority": 10**9}, False, "priority", "between"),
    ],
)
def test_each_bad_field_is_a_400_naming_it(body: dict, chat: bool, param: str, fragment: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(body, chat)
    assert caught.value.status == 400 and caught.value.param == param and fragment in caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_context_limits_and_model_names() -> None:
    request = parse_request({"prompt": "x", "max_tokens": 50}, chat=False)
    with pytest.raises(ApiError, match="too large"):
        sampling_params(request, prompt_len=60, max_model_len=100)
    with pytest.raises(ApiError, match="longer than the model context"):
        sampling_params(request, prompt_len=100, max_model_len=100)
    variants = Variants(
        "tiny", "3", [Served(n, "3", kl, "h" * 12, None) for n, kl in (("t8", 0.01), ("t4", 0.2))]
    )  # type: ignore[arg-type]
    assert [variants.pinned(m) for m in (None, "tiny", "tiny:3", "t4", "t8:3")] == [
        None,
        None,
        None,
        "t4",
        "t8",
    ]
    with pytest.raises(Refusal) as refused:
        variants.pinned("other")
    assert refused.value.reason == "not_found" and "tiny, t8, t4" in refused.value.message
    assert http_error(refused.value).status == 404
    single = Variants("tiny", "3", [Served("tiny", "3", 0.0, "h", None)])  # type: ignore[arg-type]
    assert single.pinned("tiny:3") is None
    for raw in (b"{nope", b"[1]", b"\xff"):
        with pytest.raises(ApiError):
            parse_json(raw)


@pytest.mark.parametrize(
    ("field", "value", "read"),
    [("max_tokens", 7.0, 7), ("seed", -3.0, -3), ("top_k", 5.0, 5), ("priority", 2.0, 2)],
)
def test_an_integer_written_with_a_zero_fraction_is_that_integer(field: str, value: float, read: int) -> None:
    """As JSON Schema's `integer` reads it (the published schema and the parser agree: tests/serve/test_schema)."""
    assert getattr(parse_request({"prompt": "hi", field: value}, chat=False), field) == read
    assert parse_request({"prompt": [3.0, 0]}, chat=False).prompt == [3, 0]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "max_tokens": 7.5},
        {"prompt": "hi", "max_tokens": True},
        {"prompt": "hi", "max_tokens": 1e300},
        {"prompt": "hi", "seed": 1e300},
        {"prompt": [-1]},
        {"prompt": "hi", "presence_penalty": False},
        {"prompt": "hi", "logit_bias": 0},
        {"prompt": "hi", "n": True},
        {"prompt": "hi", "user": "two\nlines"},
        {"prompt": "hi", "session_id": "a\u0085b"},
    ],
)
def test_what_only_looks_like_an_accepted_value_is_a_400(body: dict[str, object]) -> None:
    with pytest.raises(ApiError) as refused:
        parse_request(body, chat=False)
    assert refused.value.status == 400


def test_accepted_values_compare_as_json_does() -> None:
    body = {
        "prompt": "hi",
        "n": 1.0,
        "presence_penalty": 0.0,
        "logprobs": 0,
        "response_format": {"type": "text"},
    }
    assert parse_request({**body, "user": "Zoë 🐕"}, chat=False).user == "Zoë 🐕"


def test_both_max_token_fields_of_a_chat_body_are_checked() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "max_tokens": "x"}
    with pytest.raises(ApiError, match="'max_tokens' must be an integer"):
        parse_request(body, chat=True)
    body = {**body, "max_completion_tokens": None, "max_tokens": 4}
    assert parse_request(body, chat=True).max_tokens == 4


def test_a_refusal_below_http_becomes_its_http_answer() -> None:
    """Tenancy, the controller and the variants refuse with a transport-neutral `Refusal`; the OpenAI front end
    states each reason as its status, passes the caller's limits on as x-ratelimit-* headers, and says
    Retry-After only where retrying can succeed."""
    limits = {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "0"}
    over = http_error(
        Refusal("over_limit", "slow down", code="rate_limit_exceeded", retry_after=2.2, limits=limits)
    )
    assert (over.status, over.kind, over.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert over.headers == {**limits, "Retry-After": "3"}
    never = http_error(Refusal("over_limit", "too large", kind="tokens", retry_after=float("inf")))
    assert never.status == 429 and never.kind == "tokens" and "Retry-After" not in never.headers
    statuses = {reason: http_error(Refusal(reason, "no")).status for reason in REASONS}
    assert statuses == {
        "over_limit": 429,
        "overloaded": 429,
        "not_found": 404,
        "timeout": 504,
        "unavailable": 503,
    }
    missing = http_error(Refusal("not_found", "no such model", "model", "model_not_found"))
    assert missing.body() == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
