"""The fleet on a real `redis-server` (started here on a free port, stopped after): gateway, workers in this
process and as killed subprocesses, answers compared with the single-process server's for the same seed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from serve.fleet import wire as P
from serve.fleet.gateway import Gateway, GatewayConfig, create_gateway_app, ring_owner
from serve.fleet.local_redis import LocalRedis
from serve.fleet.worker import FleetWorker, WorkerConfig
from serve.http import BackgroundServer, free_port
from serve.openai import ServerInfo
from tests.serve.test_api import make_engine

STORY = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.9, "seed": 7, "ignore_eos": True}


@pytest.fixture()
def local_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path / "redis") as server:
        yield server


@contextmanager
def worker(model_dir: Path, url: str, name: str = "tiny", **config) -> Iterator[FleetWorker]:
    fleet_worker = FleetWorker(make_engine(model_dir), WorkerConfig(url, name, "1", f"hash-{name}", **config))
    stop = threading.Event()
    thread = threading.Thread(target=fleet_worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield fleet_worker
    finally:
        stop.set()
        thread.join(timeout=30)


@contextmanager
def gateway(url: str, **config) -> Iterator[str]:
    app = create_gateway_app(Gateway(GatewayConfig(url, **config)))
    with BackgroundServer(app) as base:
        yield base


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ports_below_ephemeral(count: int) -> int:
    """The first of `count` consecutive free ports under the kernel's ephemeral range: `--role all` puts its
    workers on the ports after the gateway's, and one in that range may be taken by any outgoing connection
    meanwhile (the worker then serves its /health elsewhere, as it should, and the test could not find it)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        first = random.randrange(max(1024, low - 12000), low - count)
        held = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no free ports under the ephemeral range")


def live_workers(base: str) -> int:
    response = httpx.get(f"{base}/health", timeout=5)
    return response.json().get("workers", 0) if response.status_code == 200 else 0


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Iterator[str]:
    """The single-process server: what every fleet answer must equal."""
    with BackgroundServer(make_engine(tiny_llama), ServerInfo(name="tiny", version="1")) as url:
        yield url


def sse_text(lines: list[str]) -> str:
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(e["choices"][0].get("text") or "" for e in events)


def test_enqueue_work_stream_ack(tiny_llama: Path, local_redis: LocalRedis, reference: str) -> None:
    expected = httpx.post(f"{reference}/v1/completions", json=STORY, timeout=60).json()
    with worker(tiny_llama, local_redis.url) as fleet_worker, gateway(local_redis.url) as base:
        wait_for(lambda: live_workers(base) == 1, what="the worker's heartbeat")
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [(m["id"], m["version"], m["content_hash"], m["workers"]) for m in models] == [
            ("tiny", "1", "hash-tiny", 1)
        ]
        answer = httpx.post(f"{base}/v1/completions", json=STORY, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-qpack-worker"] == fleet_worker.config.worker_id
        assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        assert answer.json()["usage"] == expected["usage"]
        with httpx.stream("POST", f"{base}/v1/completions", json={**STORY, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and sse_text(lines) == expected["choices"][0]["text"]
        chat = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "seed": 1},
            timeout=60,
        )
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        bad = httpx.post(f"{base}/v1/completions", json={**STORY, "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        too_long = httpx.post(f"{base}/v1/completions", json={**STORY, "max_tokens": 10_000}, timeout=30)
        assert too_long.status_code == 400  # the worker knows the model's length; its 400 comes back
        deleted = httpx.delete(f"{base}/v1/sessions/s1", params={"user": "ann"})
        assert deleted.status_code == 404  # the worker answered: it holds no such session (no KV offload)
        assert httpx.delete(f"{base}/v1/sessions").status_code == 400
        client = redis.Redis.from_url(local_redis.url)
        wait_for(lambda: client.xlen(fleet_worker.own) == 0, what="the worker to apply the deletion")
        for stream in (fleet_worker.own, fleet_worker.shared):
            assert client.xpending(stream, P.GROUP)["pending"] == 0  # every entry acknowledged
            assert client.xlen(stream) == 0  # and removed
        assert not client.keys(P.response_stream("*"))  # answered response streams are deleted
        assert "qpack_fleet_live_workers" in httpx.get(f"{base}/metrics").text


def test_sessions_stick_to_a_worker_and_models_route_apart(
    tiny_llama: Path, tiny_qwen2: Path, local_redis: LocalRedis
) -> None:
    with (
        worker(tiny_llama, local_redis.url) as first,
        worker(tiny_llama, local_redis.url) as second,
        worker(tiny_qwen2, local_redis.url, name="other") as other,
        gateway(local_redis.url) as base,
    ):
        wait_for(lambda: live_workers(base) == 3, what="three heartbeats")
        assert {m["id"]: m["workers"] for m in httpx.get(f"{base}/v1/models").json()["data"]} == {
            "tiny": 2,
            "other": 1,
        }
        seen: dict[str, set[str]] = {}
        for turn in range(2):
            for session in range(8):
                body = {
                    "model": "tiny",
                    "prompt": f"turn {turn}",
                    "max_tokens": 2,
                    "session_id": f"s{session}",
                }
                answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
                seen.setdefault(f"s{session}", set()).add(answer.headers["x-qpack-worker"])
        assert all(len(workers) == 1 for workers in seen.values())  # every session kept its worker
        assert set().union(*seen.values()) == {first.config.worker_id, second.config.worker_id}
        answer = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["x-qpack-worker"] == other.config.worker_id
        missing = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 503 and missing.headers["retry-after"] == "1"
        assert "tiny" in missing.json()["error"]["message"]


def test_a_slow_prompt_is_prepared_off_the_intake_loop(
    tiny_llama: Path, local_redis: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tenant's prompt that takes the tokenizer long (held here on an event) must not stop the worker's
    heartbeat, nor its reading of other requests."""
    import serve.fleet.worker as worker_module

    real, held, release = worker_module.prompt_ids, threading.Event(), threading.Event()

    def slow_prompt_ids(request, tokenizer, vocab_size):
        if request.prompt == "a very slow prompt":
            held.set()
            release.wait(30)
        return real(request, tokenizer, vocab_size)

    monkeypatch.setattr(worker_module, "prompt_ids", slow_prompt_ids)
    with (
        worker(tiny_llama, local_redis.url, heartbeat_s=0.2) as fleet_worker,
        gateway(local_redis.url) as base,
    ):
        wait_for(lambda: live_workers(base) == 1, what="the worker's heartbeat")
        client = redis.Redis.from_url(local_redis.url)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                slow = pool.submit(
                    httpx.post,
                    f"{base}/v1/completions",
                    json={"prompt": "a very slow prompt", "max_tokens": 2},
                    timeout=60,
                )
                assert held.wait(30)
                beat = float(client.hget(P.worker_key(fleet_worker.config.worker_id), "last_seen") or 0)
                quick = httpx.post(f"{base}/v1/completions", json={**STORY, "max_tokens": 2}, timeout=30)
                assert quick.status_code == 200, quick.text
                wait_for(
                    lambda: (
                        float(client.hget(P.worker_key(fleet_worker.config.worker_id), "last_seen") or 0)
                        > beat
                    ),
                    timeout=5,
                    what="a heartbeat while a prompt is being tokenized",
                )
                release.set()
                assert slow.result().status_code == 200
        finally:
            release.set()


def test_the_ring_moves_only_the_sessions_of_a_worker_that_leaves() -> None:
    workers = [P.WorkerInfo(f"w{i}", "m", "1", "h", 8, 0, 0.0) for i in range(4)]
    sessions = [f"user/{i}" for i in range(400)]
    before = {s: ring_owner(s, workers).worker_id for s in sessions}  # type: ignore[union-attr]
    counts = {w.worker_id: list(before.values()).count(w.worker_id) for w in workers}
    assert min(counts.values()) > 50  # spread over all four
    after = {s: ring_owner(s, workers[:3]).worker_id for s in sessions}  # type: ignore[union-attr]
    moved = [s for s in sessions if before[s] != after[s]]
    assert moved and all(before[s] == "w3" for s in moved)
    assert ring_owner("x", []) is None


def test_queue_full_is_429_and_no_worker_is_503(local_redis: LocalRedis) -> None:
    with gateway(local_redis.url, max_queue=2) as base:
        nobody = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert nobody.status_code == 503 and nobody.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/health").status_code == 503
        client = redis.Redis.from_url(local_redis.url)
        idle = P.WorkerInfo("idle", "tiny", "1", "h", 8, 0, time.time())  # announces, never reads
        client.hset(P.worker_key("idle"), mapping=idle.fields())
        client.hset(P.WORKERS, "idle", "tiny")
        client.xgroup_create(P.model_stream("tiny"), P.GROUP, id="0", mkstream=True)
        time.sleep(0.6)  # past the gateway's worker cache
        with httpx.Client(timeout=2) as http:
            for _ in range(2):
                with pytest.raises(httpx.ReadTimeout):  # queued: no worker takes it
                    http.post(f"{base}/v1/completions", json={"prompt": "x"})
            full = http.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert "queue" in full.json()["error"]["message"]
        assert 'qpack_fleet_queue_depth{model="tiny"} 2.0' in httpx.get(f"{base}/metrics").text


def test_redis_down_at_start_is_exit_2_in_one_line(tiny_llama: Path) -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    for role in ("gateway", "worker", "all"):
        args = [] if role == "gateway" else [str(tiny_llama)]
        run = subprocess.run(
            [sys.executable, "-m", "qpack", "serve", *args, "--role", role, "--redis", closed],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, run.stderr
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "unreachable" in lines[0] and "--redis" in lines[0], run.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "qpack", "serve", "--role", "worker", "--redis", closed],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "artifact or model" in bad.stderr


def test_redis_lost_at_runtime(tiny_llama: Path, local_redis: LocalRedis, reference: str) -> None:
    expected = httpx.post(f"{reference}/v1/completions", json=STORY, timeout=60).json()["choices"][0]["text"]
    with (
        worker(tiny_llama, local_redis.url) as _worker,
        gateway(local_redis.url, request_timeout=20.0) as base,
    ):
        wait_for(lambda: live_workers(base) == 1, what="the worker's heartbeat")
        local_redis.stop()
        started = time.monotonic()
        refused = httpx.post(f"{base}/v1/completions", json=STORY, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert time.monotonic() - started < 10
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503
        local_redis.start()  # an empty Redis (no AOF): the worker re-creates its groups and heartbeat
        wait_for(lambda: live_workers(base) == 1, timeout=60, what="the worker to come back")
        again = httpx.post(f"{base}/v1/completions", json=STORY, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected


def test_in_flight_requests_end_within_their_deadline_when_redis_goes(
    tiny_llama: Path, local_redis: LocalRedis
) -> None:
    with (
        worker(tiny_llama, local_redis.url) as _worker,
        gateway(local_redis.url, request_timeout=4.0) as base,
    ):
        wait_for(lambda: live_workers(base) == 1, what="the worker's heartbeat")
        body = {**STORY, "max_tokens": 200, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            local_redis.stop()
            rest = [line for line in lines if line]
        assert time.monotonic() - started < 4.0 + 3.0  # the deadline, plus a poll
        assert rest[-1] == "data: [DONE]"  # a well-formed stream, finished or ended with an error


def test_role_all_starts_workers_that_answer_and_stops_them_on_sigterm(
    tiny_llama: Path, local_redis: LocalRedis
) -> None:
    """`--role all`: the gateway starts its worker as `python -m serve.fleet.worker_process`, with the engine
    options it was given; SIGTERM drains the gateway and ends the worker."""
    port = ports_below_ephemeral(2)
    command = [sys.executable, "-m", "qpack", "serve", str(tiny_llama), "--role", "all", "--workers", "1"]
    command += ["--redis", local_redis.url, "--port", str(port), "--kv-memory", "16MB", "--block-size", "4"]
    command += ["--max-model-len", "256", "--prefill-dtype", "float32"]
    gateway_process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert gateway_process.poll() is None, gateway_process.stderr.read()  # type: ignore[union-attr]
            try:
                return live_workers(base) == 1
            except httpx.TransportError:
                return False

        wait_for(up, timeout=240, what="the gateway and its worker")
        worker_health = httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=5).json()
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [m["prefill_dtypes"] for m in models] == [["float32"]]
        answer = httpx.post(f"{base}/v1/completions", json={**STORY, "max_tokens": 4}, timeout=60)
        assert answer.status_code == 200 and answer.headers["x-qpack-worker"] == worker_health["worker"]
        gateway_process.send_signal(signal.SIGTERM)
        assert gateway_process.wait(timeout=90) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=2)
    finally:
        if gateway_process.poll() is None:
            gateway_process.kill()
            gateway_process.wait(timeout=10)


def start_worker_process(model_dir: Path, url: str, port: int) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "qpack", "serve", str(model_dir), "--role", "worker", "--redis", url]
    command += ["--port", str(port), "--claim-idle", "1", "--kv-memory", "16MB", "--block-size", "4"]
    command += ["--max-model-len", "256", "--threads", "1"]
    return subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def test_a_sigkilled_workers_request_is_continued_without_duplicates(
    tiny_llama: Path, local_redis: LocalRedis, reference: str
) -> None:
    """The rescuer continues from the tokens the dead worker delivered, sampling each next token from the same
    (seed, index) stream, so the one right answer is the single server's: any duplicated, missing or diverging
    token would change the text."""
    body = {**STORY, "max_tokens": 200, "stream": True, "session_id": "chat-1"}
    expected = httpx.post(f"{reference}/v1/completions", json={**body, "stream": False}, timeout=120)
    expected_text = expected.json()["choices"][0]["text"]
    process = start_worker_process(tiny_llama, local_redis.url, free_port())
    try:
        with gateway(local_redis.url) as base:
            wait_for(lambda: live_workers(base) == 1, timeout=240, what="the worker subprocess")
            name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            lines: list[str] = []
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
                victim = response.headers["x-qpack-worker"]
                iterator = response.iter_lines()
                while len([line for line in lines if line]) < 4:  # a few tokens delivered
                    lines.append(next(iterator))
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=10)
                with worker(tiny_llama, local_redis.url, name, claim_idle_s=1.0) as rescuer:
                    lines += list(iterator)
                    assert rescuer.claimed == 1
        assert victim != rescuer.config.worker_id
        lines = [line for line in lines if line]
        assert lines[-1] == "data: [DONE]"
        assert sse_text(lines) == expected_text  # every token once, in order, as the single server says
        assert rescuer.resumed_tokens >= 3  # continued, not regenerated from the start
        client = redis.Redis.from_url(local_redis.url)
        assert client.xlen(P.worker_stream(victim)) == 0
    finally:
        process.kill()
        process.wait(timeout=10)


def test_chain_takes_each_token_once_from_the_newest_attempt() -> None:
    def delta(attempt: int, tokens: int, text: str) -> P.Chunk:
        return P.Chunk("delta", tokens=tokens, text=text, attempt=attempt, ids=[100 + tokens])

    chain = P.Chain()
    assert chain.take(P.Chunk("accepted", attempt=1))
    assert chain.take(delta(1, 1, "a")) and chain.take(delta(1, 2, "b"))
    assert not chain.take(delta(1, 2, "b"))  # a repeat
    assert chain.take(P.Chunk("accepted", tokens=2, attempt=2)) is False  # the rescuer's: nothing new
    assert not chain.take(delta(2, 4, "d"))  # a gap
    assert chain.take(delta(2, 3, "c"))
    assert not chain.take(delta(1, 4, "x"))  # a stale attempt that was still running
    assert chain.take(P.Chunk("done", tokens=3, text="!", attempt=2, ids=[]))
    assert (chain.tokens, chain.ids, chain.chars, chain.attempt) == (3, [101, 102, 103], 4, 2)
    fresh = P.Chain()
    assert fresh.take(P.Chunk("accepted", attempt=2))  # the first attempt died before accepting


def test_a_closed_reader_refuses_new_streams_and_leaves_no_read_loop(local_redis: LocalRedis) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from serve.fleet.reader import ReaderClosed, ResponseReader

    async def scenario() -> None:
        control = aioredis.Redis.from_url(local_redis.url)
        reader = ResponseReader(local_redis.url, control, block_ms=200)
        await reader.open("answer:a")
        await control.xadd("answer:a", {"kind": "delta"})
        assert await reader.next("answer:a", 5) == {b"kind": b"delta"}
        assert reader.reading
        await reader.aclose()
        assert not reader.reading
        with pytest.raises(ReaderClosed):
            await reader.open("answer:b")
        await asyncio.sleep(0.3)
        assert not reader.reading and not reader.streams
        await control.aclose()

    asyncio.run(scenario())
