"""Tenants on a real server (loopback, tiny model, KV offload on), tried as a hostile tenant would: another tenant's
cached prefix, sessions, tier and priority are out of reach; limits answer 429 with OpenAI's headers while other
tenants go on; the official openai client reads `service_tier`."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve.engine.core import Engine
from serve.http import BackgroundServer
from serve.openai import ServerInfo
from serve.tenancy.tenants import TenantsSource
from tests.serve.test_api import make_engine

SUPPORT = "You are the support assistant of a toy shop. Answer in one short sentence, kindly and clearly."
TENANTS = f"""\
[tenants.acme]
keys = ["key-tenant-a"]
tier = "priority"
requests_per_minute = 600

[tenants.globex]
keys = ["key-tenant-b"]
tier = "free"
requests_per_minute = 60

[tenants.hooli]
keys = ["key-tenant-d"]
tier = "free"
requests_per_minute = 3

[tenants.initech]
keys = ["key-tenant-c"]
tokens_per_minute = 300
max_tokens = 16
max_concurrent = 1

[shared_prefixes.support]
text = "{SUPPORT}"
tenants = ["acme", "globex"]
"""
A, B, C, D = ({"Authorization": f"Bearer key-tenant-{x}"} for x in "abcd")
HISTORY = [
    {"role": "user", "content": "Once upon a time there was a little girl who liked to play in the park."},
    {"role": "assistant", "content": "She had a dog called Max who loved to run after the ball every day."},
    {"role": "user", "content": "What did the girl and her dog do when it started to rain in the park?"},
]


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    engine = make_engine(tiny_llama, kv_host_memory=8 * 2**20, max_model_len=512)
    info = ServerInfo(name="tiny", version="1", tenants=TenantsSource(path), request_timeout=60)
    with BackgroundServer(engine, info) as url:
        yield url, engine


def chat(url: str, key: dict[str, str], messages: list[dict[str, str]], **fields) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=key, timeout=60)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_another_tenant_can_neither_reuse_nor_probe_a_cached_prefix(served) -> None:
    url, _engine = served
    assert cached(chat(url, A, HISTORY, user="alice", session_id="s1")) == 0
    assert cached(chat(url, A, HISTORY, user="alice", session_id="s1")) > 0  # A's own prefix: reused
    assert cached(chat(url, B, HISTORY, user="alice", session_id="s1")) == 0  # B naming A's user: nothing
    assert cached(chat(url, A, HISTORY, user="bob")) > 0  # names inside A's tenant share A's cache


def test_a_tenant_deletes_only_its_own_sessions_and_a_foreign_one_looks_absent(served) -> None:
    url, engine = served
    chat(
        url,
        A,
        [{"role": "user", "content": "Carol asks about her order of a blue kite and a yellow boat."}],
        user="carol",
        session_id="c1",
    )
    engine.offload.manager.flush()
    foreign = httpx.delete(f"{url}/v1/sessions/c1", params={"user": "carol"}, headers=B)
    foreign_user = httpx.delete(f"{url}/v1/sessions", params={"user": "carol"}, headers=B)
    assert foreign.status_code == 404 and foreign_user.status_code == 404
    assert ("acme", "carol", "c1") in engine.offload.manager.sessions  # untouched
    own = httpx.delete(f"{url}/v1/sessions/c1", params={"user": "carol"}, headers=A)
    assert own.status_code == 200 and own.json()["blocks"] > 0
    again = httpx.delete(f"{url}/v1/sessions/c1", params={"user": "carol"}, headers=A)
    assert (again.status_code, again.json()) == (foreign.status_code, foreign.json())  # indistinguishable
    assert httpx.delete(f"{url}/v1/sessions/c1", params={"user": "carol"}).status_code == 401


def test_service_tier_and_priority_cannot_lift_a_tenant(served) -> None:
    url, engine = served
    asked_up = chat(url, B, HISTORY, service_tier="priority")
    assert asked_up.status_code == 200 and asked_up.json()["service_tier"] == "flex"
    assert chat(url, A, HISTORY).json()["service_tier"] == "priority"
    assert chat(url, A, HISTORY, service_tier="flex").json()["service_tier"] == "flex"
    assert chat(url, A, HISTORY, service_tier="turbo").status_code == 400
    engine.paused.set()  # hold both in the queue to see the order they would be admitted in
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pushy = pool.submit(chat, url, B, HISTORY, priority=-1_000_000)
            _wait(lambda: engine.scheduler.num_waiting == 1)
            polite = pool.submit(chat, url, A, HISTORY, priority=1000)
            _wait(lambda: engine.scheduler.num_waiting == 2)
            head = engine.scheduler.waiting.head()
            assert head.owner.tenant == "acme" and head.owner.tier == "priority"
            engine.paused.clear()
            assert pushy.result().status_code == 200 and polite.result().status_code == 200
    finally:
        engine.paused.clear()


def test_a_tenant_over_its_request_rate_gets_429_while_another_goes_on(served) -> None:
    url, engine = served
    codes = []
    for _ in range(12):
        response = chat(url, D, HISTORY[:1], max_tokens=1)
        codes.append(response.status_code)
        if response.status_code == 429:
            break
    assert codes[-1] == 429 and set(codes[:-1]) == {200}
    refused = response
    assert (
        refused.json()["error"]["type"] == "requests"
        and refused.json()["error"]["code"] == "rate_limit_exceeded"
    )
    assert int(refused.headers["retry-after"]) >= 1
    assert len(codes) == 4 and refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    other = chat(url, A, HISTORY[:1], max_tokens=1)
    assert other.status_code == 200 and other.headers["x-ratelimit-limit-requests"] == "600"
    metrics = httpx.get(f"{url}/metrics").text
    assert 'qpack_tenant_rate_limited_total{limit="requests",tenant="hooli",tier="free"} 1.0' in metrics
    assert 'qpack_tenant_requests_total{status="429",tenant="hooli",tier="free"} 1.0' in metrics
    assert 'qpack_tenant_queue_seconds_count{tenant="acme",tier="priority"}' in metrics
    assert 'qpack_tenant_tokens_total{kind="prompt",tenant="acme",tier="priority"}' in metrics
    assert "key-tenant" not in metrics
    del engine


def _arrivals(url: str, tier: str) -> float:
    prefix = f'qpack_control_arrivals_total{{tier="{tier}"}} '
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


def test_only_requests_the_tenants_limits_let_in_are_arrivals_for_the_controller(served) -> None:
    url, _engine = served
    before = _arrivals(url, "free")
    codes = [chat(url, D, HISTORY[:1], max_tokens=1).status_code for _ in range(6)]
    assert 429 in codes
    assert _arrivals(url, "free") - before == codes.count(200)


def test_tokens_per_minute_max_tokens_and_concurrency(served) -> None:
    url, engine = served
    prompt = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
    above = httpx.post(f"{url}/v1/completions", json={**prompt, "max_tokens": 17}, headers=C)
    assert above.status_code == 400 and above.json()["error"]["param"] == "max_tokens"
    first = httpx.post(f"{url}/v1/completions", json={**prompt, "max_tokens": 16}, headers=C, timeout=60)
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    reserved = first.json()["usage"]["prompt_tokens"] + 16
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == pytest.approx(300 - reserved, abs=1)
    second = httpx.post(f"{url}/v1/completions", json={**prompt, "max_tokens": 16}, headers=C, timeout=60)
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert remaining >= 300 - used - reserved - 1  # what the first did not use came back (and some refill)
    long_prompt = list(range(100, 390))  # 290 tokens: with 16 more, over the 300 a minute
    huge = httpx.post(f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 16}, headers=C)
    assert huge.status_code == 429 and "request too large" in huge.json()["error"]["message"], huge.text
    assert "retry-after" not in huge.headers  # waiting would not help
    engine.paused.set()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post, f"{url}/v1/completions", json={**prompt, "max_tokens": 2}, headers=C, timeout=60
            )
            _wait(lambda: engine.scheduler.num_waiting == 1)
            busy = httpx.post(f"{url}/v1/completions", json={**prompt, "max_tokens": 2}, headers=C)
            assert busy.status_code == 429 and "in flight" in busy.json()["error"]["message"]
            engine.paused.clear()
            assert held.result().status_code == 200
    finally:
        engine.paused.clear()
    assert (
        httpx.post(
            f"{url}/v1/completions", json={**prompt, "max_tokens": 2}, headers=C, timeout=60
        ).status_code
        == 200
    )


def test_a_shared_system_prompt_is_shared_and_nothing_after_it(served) -> None:
    url, _engine = served
    system = {"role": "system", "content": SUPPORT}
    a_prompt = [system, {"role": "user", "content": "Where is my parcel with the red train set I ordered?"}]
    assert cached(chat(url, A, a_prompt)) == 0
    warm = cached(chat(url, A, a_prompt))
    from_b = cached(chat(url, B, a_prompt))  # B sends A's exact prompt: only the shared text is reused
    assert 0 < from_b < warm
    other = [system, {"role": "user", "content": "Do you sell wooden blocks for toddlers?"}]
    assert cached(chat(url, B, other)) >= from_b  # the shared blocks, and B's own after them
    assert cached(chat(url, C, a_prompt)) == 0  # initech is not listed for this prefix
    assert cached(chat(url, A, a_prompt, cache_salt="mine")) == 0  # a salt opts out of sharing


def test_the_openai_client_reads_service_tier_and_the_rate_headers(served) -> None:
    openai = pytest.importorskip("openai")
    url, _engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="key-tenant-a", max_retries=0)
    completion = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=2, temperature=0)
    assert completion.service_tier == "priority"
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HISTORY, max_tokens=2, service_tier="flex"
    )
    assert raw.parse().service_tier == "flex" and raw.headers["x-ratelimit-limit-requests"] == "600"
    stream = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=2, stream=True)
    assert {chunk.service_tier for chunk in stream} == {"priority"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="key-tenant-x", max_retries=0).models.list()


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
