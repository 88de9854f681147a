"""Hostile traffic for a real server with two tenants: Hypothesis strategies for chat and completions bodies
(valid, edge-case and hostile: random JSON, wrong types, raw bytes that are not JSON or not UTF-8, deep nesting,
long numbers), headers (keys that are wrong, missing or another scheme; content types) and sessions-API calls;
and the harness that sends them as one tenant (B) while the other (A) sends the same greedy request over and
over, so that a test, or the long run in `benchmarks/fuzz.py`, can check what no input may do: a 5xx, /health
going down, or A's text changing.

A's requests and B's run on the same server at once, so A's greedy text must equal its text alone: the server
runs batch-invariant, where a row's numbers do not depend on the batch beside it (`serve.core.runner`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import strategies as st

from serve.http import BackgroundServer
from serve.openai import ServerInfo
from serve.tenancy.tenants import TenantsSource
from tests.serve.test_api import make_engine

KEY_A, KEY_B = "key-fuzz-tenant-a", "key-fuzz-tenant-b"
TENANTS = f"""\
[tenants.alpha]
keys = ["{KEY_A}"]
tier = "standard"

[tenants.beta]
keys = ["{KEY_B}"]
tier = "standard"
"""
A_BODY = {
    "messages": [{"role": "user", "content": "Once upon a time there was a little dog who liked to run."}],
    "max_tokens": 12,
    "temperature": 0,
    "user": "alice",
    "session_id": "s1",
}
SERVER_ERROR = re.compile(r'"type":\s*"server_error"')  # an error event inside a 200 stream
NAMES = ["alice", "s1", "bob", "", " ", "../../etc/passwd", "a" * 300, "\u0000", "é", "\ud800", "%2F", "*"]

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
texts = st.text(max_size=200) | st.sampled_from(["", " ", "\n", "\ufffd", "😀" * 40, "<|im_start|>", "\x00"])
edge_numbers = st.sampled_from(
    [
        0,
        1,
        -1,
        1e-300,
        1e-6,
        1e-5,
        2,
        2.0000001,
        1e308,
        -1e308,
        2**31,
        2**63,
        -(2**63),
        10**40,
        0.5,
        True,
        "1",
    ]
)


def _maybe(key: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(st.just({}), values.map(lambda v: {key: v}))


sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2) | edge_numbers,
        "top_p": st.floats(0, 1) | edge_numbers,
        "top_k": st.integers(-1, 50) | edge_numbers,
        "max_tokens": st.integers(1, 6) | edge_numbers,
        "seed": st.integers(-(2**64), 2**64) | edge_numbers,
        "stop": st.one_of(texts, st.lists(texts, max_size=5)),
        "priority": st.integers(-(10**9), 10**9) | edge_numbers,
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.sampled_from([{"include_usage": True}, {}, None, "yes"]),
        "user": st.sampled_from(NAMES) | texts,
        "session_id": st.sampled_from(NAMES) | texts,
        "service_tier": st.sampled_from(["priority", "standard", "flex", "auto", "default", "gold"]) | texts,
        "cache_salt": texts,
        "model": st.sampled_from(["tiny", "other", ""]) | texts,
        "n": edge_numbers,
        "logprobs": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    },
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]),
        "content": texts
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]), "text": texts | json_values}
            ),
            max_size=3,
        ),
    }
)
chat_bodies = st.builds(
    lambda m, s: {"messages": m, **s}, st.lists(message, min_size=1, max_size=4), sampling
)
completion_bodies = st.builds(
    lambda p, s: {"prompt": p, **s},
    texts | st.lists(st.integers(-5, 70_000), min_size=1, max_size=20),
    sampling,
)


def _mutated(body: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**body, key: value}


def with_random_field(bodies: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    keys = st.sampled_from(
        ["messages", "prompt", "max_tokens", "temperature", "stop", "user", "x"]
    ) | st.text(max_size=10)
    return st.builds(_mutated, bodies, keys, json_values)


RAW_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "hi"',
    b"",
    b"null",
    b'"prompt"',
    b'{"messages": [' + b'{"role":"user","content":""},' * 3000 + b'{"role":"user","content":""}]}',
    b'{"messages": [{"role":"user","content":[{"type":"text","text":7}]}]}',
]


def _raw(index: int) -> bytes:
    return RAW_BODIES[index]


raw_bodies = st.one_of(st.binary(max_size=200), st.integers(0, len(RAW_BODIES) - 1).map(_raw))


@dataclass(frozen=True)
class Call:
    """One hostile HTTP call: method, path, headers and body bytes."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""

    def __repr__(self) -> str:  # what Hypothesis prints for a failing example: short
        return f"Call({self.method} {self.path[:80]!r} headers={list(self.headers)} body={self.body[:160]!r})"


header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)
VALID_AUTH = {"Authorization": f"Bearer {KEY_B}"}
wrong_auth = st.sampled_from(
    [
        {"Authorization": f"bearer {KEY_B}"},
        {"Authorization": f"Basic {KEY_B}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {KEY_A[:-1]}"},
        {},
    ]
) | header_values.map(lambda v: {"Authorization": f"Bearer {v}".strip()})
# Four calls in five carry B's key, so that most reach the parser and the engine; the rest probe the key check
auth = st.integers(0, 4).flatmap(lambda i: wrong_auth if i == 4 else st.just(VALID_AUTH))
extra_headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data", ""]),
        "Content-Encoding": st.sampled_from(["gzip", "br", "identity"]),
        "X-Forwarded-For": header_values,
        "OpenAI-Organization": header_values,
        "Accept": st.sampled_from(["text/event-stream", "*/*", "application/xml"]),
    },
)


def _json_bytes(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _generation(path: str) -> st.SearchStrategy[Call]:
    bodies = chat_bodies if path.endswith("chat/completions") else completion_bodies
    payload = st.one_of(
        bodies.map(_json_bytes),
        with_random_field(bodies).map(_json_bytes),
        json_values.map(_json_bytes),
        raw_bodies,
    )
    return st.builds(lambda h, x, b: Call("POST", path, {**h, **x}, b), auth, extra_headers, payload)


def _quoted(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def _sessions_call(one: bool, name: str, user: str | None, headers: dict[str, str]) -> Call:
    path = f"/v1/sessions/{_quoted(name)}" if one else "/v1/sessions"
    if user is not None:
        path += f"?user={_quoted(user)}"
    return Call("DELETE", path, headers)


session_calls = st.builds(
    _sessions_call,
    st.booleans(),
    st.sampled_from(NAMES) | st.text(min_size=1, max_size=80),
    st.none() | st.sampled_from(NAMES) | st.text(max_size=80),
    auth,
)
odd_calls = st.builds(
    Call,
    st.sampled_from(["GET", "PUT", "PATCH", "OPTIONS", "HEAD", "DELETE"]),
    st.sampled_from(
        ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/v1/sessions/x/y", "/"]
    ),
    auth,
    st.binary(max_size=50),
)
calls = st.one_of(
    _generation("/v1/chat/completions"),
    _generation("/v1/completions"),
    session_calls,
    odd_calls,
)


@dataclass
class Tally:
    """What the hostile tenant got, by status, and what went wrong (the checks' failures, kept for the report)."""

    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    health_failures: int = 0
    reference_runs: int = 0
    reference_mismatches: list[str] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())


class Fuzzer:
    """A real server with two tenants in one tier; `send` makes one of B's calls and checks it, while a thread
    sends A's greedy request over and over and compares each answer with A's text alone."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.model_dir, self.workdir = model_dir, workdir
        self.tally = Tally()
        self.client = httpx.Client(timeout=120)
        self.url = ""
        self.alone = ""
        self._stop = threading.Event()

    @contextmanager
    def running(self) -> Iterator[Fuzzer]:
        tenants = self.workdir / "tenants.toml"
        tenants.write_text(TENANTS)
        engine = make_engine(
            self.model_dir, kv_host_memory=8 * 2**20, max_model_len=256, batch_invariant=True
        )
        info = ServerInfo(name="tiny", version="1", tenants=TenantsSource(tenants), request_timeout=60)
        with BackgroundServer(engine, info) as url:
            self.url = url
            self.alone = self._reference()
            alongside = threading.Thread(target=self._reference_loop, name="fuzz-tenant-a", daemon=True)
            alongside.start()
            try:
                yield self
            finally:
                self._stop.set()
                alongside.join(timeout=120)
                self.client.close()

    def _reference(self) -> str:
        response = httpx.post(
            f"{self.url}/v1/chat/completions",
            json=A_BODY,
            headers={"Authorization": f"Bearer {KEY_A}"},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    def _reference_loop(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                response = client.post(
                    f"{self.url}/v1/chat/completions",
                    json=A_BODY,
                    headers={"Authorization": f"Bearer {KEY_A}"},
                )
                self.tally.reference_runs += 1
                text = (
                    response.json()["choices"][0]["message"]["content"]
                    if response.status_code == 200
                    else None
                )
                if text != self.alone:
                    self.tally.reference_mismatches.append(f"{response.status_code}: {response.text[:300]}")

    def send(self, call: Call) -> int:
        """Make the call; a 5xx, or a server error inside a 200 stream, is recorded (and returned as 500)."""
        response = self.client.request(
            call.method, self.url + call.path, headers=call.headers, content=call.body
        )
        status = response.status_code
        if status < 500 and SERVER_ERROR.search(response.text):
            status = 500
        self.tally.statuses[status] += 1
        if status >= 500:
            self.tally.server_errors.append(f"{status} for {call!r}: {response.text[:300]}")
        return status

    def healthy(self) -> bool:
        ok = self.client.get(f"{self.url}/health").status_code == 200
        self.tally.health_failures += not ok
        return ok
