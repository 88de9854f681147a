"""The HTTP API on a real server (loopback) with a tiny model: happy paths, every error, aborts."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from quantize.model.sources import load_model, load_tokenizer, resolve_model
from serve.engine.config import CacheConfig, EngineConfig
from serve.engine.core import Engine
from serve.http import BackgroundServer
from serve.openai import ServerInfo
from serve.tenancy.tenants import TenantsSource
from tests.serve.engines import config_from_options


def make_engine(model_dir: Path, **kwargs) -> Engine:
    source = resolve_model(str(model_dir))
    config = config_from_options(**{"block_size": 4, "kv_memory": "16MB", "max_model_len": 256, **kwargs})
    return Engine(load_model(source), load_tokenizer(source), config)


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    engine = make_engine(tiny_llama)
    with BackgroundServer(engine, ServerInfo(name="tiny", version="3")) as url:
        yield url, engine


def test_metrics_ask_for_their_key_when_the_server_has_one(tiny_llama: Path) -> None:
    """/metrics labels name tenants and tiers: with `--metrics-key` only its bearer reads them; /health stays
    open (load balancers probe it)."""
    info = ServerInfo(name="tiny", version="3", metrics_key="scrape-secret")
    with BackgroundServer(make_engine(tiny_llama), info) as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        wrong = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer scrape-secreT"})
        assert wrong.status_code == 401 and "--metrics-key" in wrong.json()["error"]["message"]
        right = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer scrape-secret"})
        assert right.status_code == 200 and "qpack_queue_depth" in right.text
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_fleet_workers_metrics_ask_for_the_key_too(tiny_llama: Path) -> None:
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from serve.fleet.run import worker_app

    worker = SimpleNamespace(engine=make_engine(tiny_llama), claimed=0)
    client = TestClient(worker_app([worker], "scrape-secret"))  # type: ignore[list-item]
    assert client.get("/metrics").status_code == 401
    answer = client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
    assert answer.status_code == 200 and "qpack_fleet_claims_total 0" in answer.text
    assert TestClient(worker_app([worker])).get("/metrics").status_code == 200  # type: ignore[list-item]


def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_models_health_metrics(server) -> None:
    url, _engine = server
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["version"] == "3"
    numerics = models["data"][0]["numerics"]
    assert numerics["prefill_dtype"] == "float32" and numerics["batch_invariant"] is False
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    httpx.post(f"{url}/v1/completions", json={"prompt": "hello there", "max_tokens": 3, "temperature": 0})
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "qpack_queue_depth",
        "qpack_kv_blocks_used",
        "qpack_kv_blocks_total",
        "qpack_prefix_cache_hit_rate",
        "qpack_time_to_first_token_seconds_bucket",
        "qpack_time_per_output_token_seconds",
        "qpack_generation_tokens_total",
    ):
        assert name in text, name


def test_completion_and_chat(server) -> None:
    url, _ = server
    body = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] > 3
    again = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    ).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 4


def test_streaming_completion_and_chat(server) -> None:
    url, _ = server
    payload = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=payload) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = [line for line in response.iter_lines() if line]
    assert raw[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in raw[:-1]]
    assert events[-1]["usage"]["completion_tokens"] == 6
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    whole = httpx.post(
        f"{url}/v1/completions",
        json={k: v for k, v in payload.items() if k not in ("stream", "stream_options")},
    ).json()
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole["choices"][0]["text"]
    chat = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat) as response:
        events = sse_events(response)
    assert (
        events[0]["choices"][0]["delta"] == {"role": "assistant"}
        and events[0]["object"] == "chat.completion.chunk"
    )


@pytest.mark.parametrize(
    ("payload", "status", "fragment"),
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be at least 1"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "too large"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "'max_tokens' must be an integer"),
        ({"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": "x", "temperature": 5}, 400, "between 0.0 and 2.0"),
        ({"prompt": "x", "n": 2}, 400, "'n' is not supported"),
        ({"prompt": "x", "logprobs": 3}, 400, "'logprobs' is not supported"),
        ({"prompt": "x", "stop": 5}, 400, "'stop' must be a string"),
        ({"prompt": ""}, 400, "must not be empty"),
        ({"prompt": 12}, 400, "'prompt' must be a non-empty string"),
        ({"prompt": [1, 99999]}, 400, "token ids must be in"),
        ({"prompt": " ".join(["word"] * 300)}, 400, "longer than the model context"),
        ({"prompt": "x", "model": "other"}, 404, "not served here"),
        ({"prompt": "x", "stream": "yes"}, 400, "'stream' must be a boolean"),
    ],
)
def test_completion_errors(server, payload, status, fragment) -> None:
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_malformed_json_and_bad_messages(server) -> None:
    url, _ = server
    response = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": []}).status_code == 400
    bad_role = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}
    )
    assert bad_role.status_code == 400 and "role" in bad_role.json()["error"]["message"]


def test_client_disconnect_aborts_and_frees_blocks(server) -> None:
    url, engine = server
    payload = {
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=payload) as response:
        lines = response.iter_lines()
        next(lines)
        assert engine.pool.num_used > 0
    deadline = time.monotonic() + 5
    while engine.pool.num_used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.pool.num_used == 0 and not engine.streams
    assert 'finish_reason="abort"' in httpx.get(f"{url}/metrics").text


def test_api_key_queue_bound_and_timeout(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1, max_queue=1)
    tenants = TenantsSource(api_keys=("sekret", "other"))
    info = ServerInfo(name="tiny", version="1", tenants=tenants, request_timeout=1.0)
    with BackgroundServer(engine, info) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
        assert (
            httpx.post(
                f"{url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer other"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekretX"}).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic sekret"}).status_code == 401
        engine.paused.set()  # hold work in the queue
        request = {"prompt": "Once", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=30) as client:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                queued = pool.submit(client.post, f"{url}/v1/completions", json=request, headers=auth)
                deadline = time.monotonic() + 5
                while engine.scheduler.num_waiting < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                busy = client.post(f"{url}/v1/completions", json=request, headers=auth)
                assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
                assert busy.json()["error"]["type"] == "rate_limit_error"
                time.sleep(1.1)  # past the 1 s request timeout while still queued
                engine.paused.clear()
                timed_out = queued.result()
        assert timed_out.status_code == 504 and "timed out" in timed_out.json()["error"]["message"]
        fine = httpx.post(f"{url}/v1/completions", json=request, headers=auth, timeout=30)
        assert fine.status_code == 200
    assert engine.pool.num_used == 0
    assert "qpack_requests_rejected_total 1.0" in engine.metrics.render().decode()


def test_bodies_over_the_limit_get_413_before_parsing(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    info = ServerInfo(name="tiny", version="1", max_request_bytes=4096)
    with BackgroundServer(engine, info) as url:
        junk = {"prompt": "hi", "max_tokens": 1, "junk": "a" * 10_000}
        sized = httpx.post(f"{url}/v1/completions", json=junk)
        assert sized.status_code == 413 and sized.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * 1000
            yield b'"}'

        chunked = httpx.post(f"{url}/v1/completions", content=chunks())
        assert chunked.status_code == 413
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


def test_prompts_that_cannot_fit_are_refused_untokenized_and_tokenizing_is_off_the_loop(
    tiny_llama: Path,
) -> None:
    engine = make_engine(tiny_llama)
    threads: list[str] = []
    tokenizer = engine.tokenizer
    real_call = type(tokenizer).__call__

    class Spy(type(tokenizer)):  # type: ignore[misc]
        def __call__(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return real_call(self, *args, **kwargs)

    tokenizer.__class__ = Spy
    with BackgroundServer(engine, ServerInfo(name="tiny", version="1")) as url:
        fine = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2})
        assert fine.status_code == 200
        assert threads and all(name.startswith("qpack-tokenize") for name in threads), threads
        calls = len(threads)
        huge = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 100_000, "max_tokens": 2})
        assert huge.status_code == 400 and "cannot fit the model context" in huge.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "x" * 500_000}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 400
        empty = {"role": "user", "content": ""}
        flood = httpx.post(f"{url}/v1/chat/completions", json={"messages": [empty] * 125_000})
        assert flood.status_code == 400 and "at most 2,048 are accepted" in flood.json()["error"]["message"]
        fits_the_cap = httpx.post(f"{url}/v1/chat/completions", json={"messages": [empty] * 2048})
        assert fits_the_cap.status_code == 400, fits_the_cap.text  # 2,048 messages: more than the context
        assert "2,048 messages at" in fits_the_cap.json()["error"]["message"]
        assert len(threads) == calls  # refused before any tokenizing


@pytest.mark.parametrize(
    ("endpoint", "payload", "fragment"),
    [
        (
            "completions",
            {"prompt": "a\ud800b", "max_tokens": 8},
            "'prompt' holds an unpaired UTF-16 surrogate",
        ),
        ("chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
        ("completions", {"prompt": "a", "stop": ["\ud800"]}, "'stop'"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    server, endpoint: str, payload: dict, fragment: str
) -> None:
    url, _ = server
    body = json.dumps(
        payload
    ).encode()  # json.dumps escapes the surrogate as \\ud800, as a JS client sends it
    response = httpx.post(f"{url}/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]


def test_a_bug_is_a_json_500_never_plain_text(tiny_llama: Path, monkeypatch) -> None:
    engine = make_engine(tiny_llama)

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "add", broken)
    with BackgroundServer(engine, ServerInfo(name="tiny", version="1")) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error" and "a bug" not in response.text


def test_a_non_streaming_client_that_disconnects_frees_its_blocks_at_once(tiny_llama: Path) -> None:
    """Tokens keep arriving (20 ms steps) while the client is gone: the abort must not wait for a quiet spell."""
    engine = make_engine(tiny_llama)
    run = engine.runner.run

    def slow(batch):
        time.sleep(0.02)
        return run(batch)

    engine.runner.run = slow  # type: ignore[method-assign]
    payload = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with BackgroundServer(engine, ServerInfo(name="tiny", version="1")) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=payload, timeout=httpx.Timeout(5.0, read=0.5))
        deadline = time.monotonic() + 1.0  # the bound: blocks back within a second of the disconnect
        while (engine.pool.num_used or engine.streams) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.pool.num_used == 0 and not engine.streams
        assert 'finish_reason="abort"' in engine.metrics.render().decode()


def test_a_server_on_int8_prompts_reports_and_routes_by_their_measured_kl(tiny_qwen2_artifact: Path) -> None:
    """With `--prefill-dtype int8` the KL a served artifact carries (/v1/models, precision routing) is the one
    `qpack quantize` measured for prompts on int8 activations, not the exact path's; the engine says so."""
    from quantize.io.artifact import read_manifest
    from serve.loading import build_engine, load_for_serving

    quality = read_manifest(tiny_qwen2_artifact)["quality"]
    exact, int8 = (load_for_serving(str(tiny_qwen2_artifact), prefill_dtype=d) for d in ("float32", "int8"))
    assert (exact.kl, int8.kl) == (quality["kl"], quality["prompt_int8"]["kl"]) and exact.kl != int8.kl
    engine = build_engine(
        int8, EngineConfig(cache=CacheConfig(block_size=4, memory="8MB"), prefill_dtype="int8")
    )
    assert engine.numerics()["prefill_dtype"] == "int8"
    assert "int8 activations" in str(engine.numerics()["prompt_path"])


def test_the_prefill_dtype_is_set_on_the_model_and_keys_its_kv(tiny_qwen2_artifact: Path) -> None:
    """`--prefill-dtype bfloat16` reaches every quantized linear (fused ones included), and KV computed on one
    numeric path is never reused on another: the prefix-cache namespace and the stored blocks' key differ."""
    from quantize.runtime.modules import QuantLinear
    from serve.loading import build_engine, load_for_serving

    engines = {
        dtype: build_engine(
            load_for_serving(str(tiny_qwen2_artifact)),
            EngineConfig(cache=CacheConfig(block_size=4, memory="8MB"), prefill_dtype=dtype),
        )
        for dtype in ("float32", "bfloat16")
    }
    for dtype, engine in engines.items():
        fused = [c for plan in engine.runner.plans for c in plan.qkv.calls + plan.gate_up.calls]
        quantized = [m for m in [*engine.model.modules(), *fused] if isinstance(m, QuantLinear)]
        assert quantized and {str(m.prefill_dtype) for m in quantized} == {f"torch.{dtype}"}
        assert engine.numerics()["prefill_dtype"] == dtype
    assert engines["float32"].namespace != engines["bfloat16"].namespace
    with pytest.raises(Exception, match="prefill dtype must be one of float32, bfloat16, int8"):
        build_engine(load_for_serving(str(tiny_qwen2_artifact)), EngineConfig(prefill_dtype="fp8"))


def test_cache_salt_keeps_tenants_prefixes_apart(server) -> None:
    url, _ = server
    prompt = "Zebra violin quartz marmalade: seven brave lanterns hummed over the sleepy harbour at dawn."

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        usage = httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    cached("tenant-a")
    assert cached("tenant-a") > 0  # the same tenant reuses its own prefix
    assert cached("tenant-b") == 0 and cached(None) == 0  # others neither share nor can probe it
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "cache_salt": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
