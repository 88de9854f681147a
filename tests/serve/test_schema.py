"""schemathesis against the server's own `/openapi.json` (`serve.openai.schema`): bodies and parameters drawn from
the schema (positive) and from its negation (negative) are sent as tenant B of a real two-tenant server, while
tenant A's greedy request runs alongside (`tests/serve/hostile.py`).

Every response must be one the schema documents (status, content type, body shape), never a 5xx; a body the
schema calls invalid must get a 4xx, and one it calls valid a 2xx, or a refusal the schema says no static
description can rule out (`LIMITS`: the prompt against the context, a tenant's limits); and A's text never
changes. A failure means the schema and the parser disagree: fix whichever is wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks

from serve.openai import schema as described
from serve.openai.protocol import ApiError, parse_request
from tests.serve.hostile import KEY_B, Fuzzer, chat_bodies, completion_bodies, json_values, with_random_field

EXAMPLES = {  # per operation and mode: the bodies get the most
    ("POST", "/v1/chat/completions"): 80,
    ("POST", "/v1/completions"): 80,
    ("DELETE", "/v1/sessions/{session_id}"): 30,
    ("DELETE", "/v1/sessions"): 30,
    ("GET", "/v1/models"): 5,
    ("GET", "/health"): 5,
    ("GET", "/metrics"): 5,
}
# Refusals of a valid body that depend on state, not shape: the prompt's tokens against the context, the
# tenant's limits and load, and whether the named session exists
LIMITS = {
    "context_length_exceeded",
    "max_tokens_above_limit",
    "rate_limit_exceeded",
    "overloaded",
    "session_not_found",
}


@pytest.fixture(scope="module")
def fuzzer(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzer]:
    with Fuzzer(tiny_llama, tmp_path_factory.mktemp("schema")).running() as running:
        yield running
    assert not running.tally.reference_mismatches, running.tally.reference_mismatches[:3]


@pytest.fixture(scope="module")
def api_schema(fuzzer: Fuzzer) -> Any:
    loaded = schemathesis.openapi.from_url(f"{fuzzer.url}/openapi.json")
    loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return loaded


@schemathesis.check
def valid_data_is_served(ctx: Any, response: Any, case: Any) -> bool | None:
    """A body the schema calls valid is served, or refused only for a reason no schema can state."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    code = None
    with contextlib.suppress(ValueError):
        code = response.json().get("error", {}).get("code")
    if response.status_code in (400, 404, 429, 503) and code in LIMITS:
        return None
    if code == "invalid_json" and "digits" in response.text:
        return None  # an integer literal over 64 digits in a field the schema leaves open: JSON Schema sees values
    raise AssertionError(f"a body valid under the schema got {response.status_code}: {response.text[:300]}")


# Negative data needs something to negate: the GET routes take no parameters or body
CASES = [
    (method, path, mode)
    for method, path in EXAMPLES
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if method != "GET" or mode is GenerationMode.POSITIVE
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_the_server_does_what_its_schema_says(
    api_schema: Any, fuzzer: Fuzzer, method: str, path: str, mode: GenerationMode
) -> None:
    @settings(
        max_examples=EXAMPLES[method, path],
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    def served(case: Any) -> None:
        case.call_and_validate(
            headers={"Authorization": f"Bearer {KEY_B}"},
            timeout=120,
            excluded_checks=[checks.positive_data_acceptance],
            additional_checks=[valid_data_is_served],
        )
        assert fuzzer.healthy()

    served()


def test_the_schema_describes_every_route(api_schema: Any) -> None:
    described = {(o.ok().method.upper(), o.ok().path) for o in api_schema.get_all_operations()}
    assert described == set(EXAMPLES)


def test_the_other_tenants_text_never_changed_under_schema_traffic(fuzzer: Fuzzer) -> None:
    assert fuzzer.tally.reference_runs > 0
    assert not fuzzer.tally.reference_mismatches, fuzzer.tally.reference_mismatches[:3]


def _sendable(body: Any) -> bool:
    """Whether the body can travel as UTF-8 JSON (a lone surrogate cannot, so no schema can speak of it)."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _verdicts(body: Any, chat: bool) -> tuple[bool, bool]:
    """(valid under the schema, taken by the parser) for one body, the schema judged by jsonschema-rs."""
    validator = jsonschema_rs.validator_for(described.chat_body() if chat else described.completion_body())
    try:
        parse_request(body, chat=chat)
        taken = True
    except ApiError:
        taken = False
    return validator.is_valid(body), taken


bodies = {
    True: st.one_of(
        chat_bodies, with_random_field(chat_bodies), st.dictionaries(st.text(max_size=12), json_values)
    ),
    False: st.one_of(completion_bodies, with_random_field(completion_bodies)),
}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_body_is_valid_under_the_schema_exactly_when_the_parser_takes_it(chat: bool) -> None:
    """Hostile bodies (edge numbers, wrong types, stray fields) judged twice: by jsonschema-rs against the
    published schema and by `parse_request`. Every disagreement is a lie in the schema or a gap in the parser."""

    @settings(max_examples=1000, deadline=None, database=None, derandomize=True)
    @given(body=bodies[chat])
    def agree(body: Any) -> None:
        assume(_sendable(body))
        valid, taken = _verdicts(body, chat)
        assert valid == taken, (
            f"schema says {'valid' if valid else 'invalid'}, parser {'took' if taken else 'refused'}"
        )

    agree()


def _probes(spec: dict[str, Any]) -> list[Any]:
    """Values at and just past every bound a property's schema declares."""
    values: list[Any] = []
    for option in spec.get("anyOf", [spec]):
        if "enum" in option:
            values += [*option["enum"], "not-a-member", 7]
        if option.get("type") in ("integer", "number"):
            low, high = option["minimum"], option["maximum"]
            step = 1 if option["type"] == "integer" else None
            values += [low, high]
            values += (
                [low - 1, high + 1]
                if step
                else [math.nextafter(low, -math.inf), math.nextafter(high, math.inf)]
            )
        if option.get("type") == "string":
            shortest, longest = option.get("minLength", 0), option.get("maxLength", 300)
            values += [
                "a" * shortest,
                "a" * longest,
                "a" * (longest + 1),
                *(["a" * (shortest - 1)] if shortest else []),
            ]
        if option.get("type") == "array" and "maxItems" in option:
            values += [["a"] * option["maxItems"], ["a"] * (option["maxItems"] + 1)]
    return values


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_declared_bound_is_the_parsers_bound(chat: bool) -> None:
    """Each property at its schema's minimum, maximum, length and item limits and one step past them: valid under
    the schema exactly when the parser takes it."""
    body_schema = described.chat_body() if chat else described.completion_body()
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    disagreements = []
    for name, spec in body_schema["properties"].items():
        for value in _probes(spec):
            valid, taken = _verdicts({**base, name: value}, chat)
            if valid != taken:
                disagreements.append(f"{name}={str(value)[:40]}: schema {valid}, parser {taken}")
    assert not disagreements, disagreements
