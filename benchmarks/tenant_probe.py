"""The hostile-tenant probe of issue 24, replayed against a real `qpack serve`: what tenant B can learn of, or do
to, tenant A, and what a reload and the limits do. Prints one table and writes it as JSON.

    python benchmarks/tenant_probe.py ARTIFACT [--out runs/tenant-probe.json]

Two servers are started on the artifact, as the issue ran them: one with two `--api-key`s (one tenant, as
`--api-key` always was: the keys share a cache), one with a tenants file making A (`acme`, priority tier) and B
(`globex`, free tier, 8 requests a minute) two tenants, both with `--isolate-users --kv-host-memory 512MB`. The
prompt is a ~160-token chat turn (SmolLM2). It also times `Tenants.authenticate` over 10,000 configured keys (every key is
compared, in constant time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TENANTS = """\
[tenants.acme]
keys = ["key-tenant-a"]
tier = "priority"
requests_per_minute = 600

[tenants.globex]
keys = ["key-tenant-b"]
tier = "free"
requests_per_minute = 8
"""
A, B = {"Authorization": "Bearer key-tenant-a"}, {"Authorization": "Bearer key-tenant-b"}
TURN = (
    "I run a small bakery and I am thinking about moving from paper order slips to a simple tablet app. "
    "We take about forty orders a day, mostly by phone, and two people work the counter. I worry about the "
    "cost, about staff learning it, and about what happens when the internet goes down in the middle of the "
    "morning rush. Could you walk me through what to look for in such an app, what questions to ask vendors, "
    "and how to run the switch over a couple of weeks without losing orders? Please keep it practical, with "
    "a short checklist at the end that I can print and pin above the counter for the whole team to follow."
)


def start(artifact: str, extra: list[str], port: int) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "qpack", "serve", artifact, "--port", str(port), "--isolate-users"]
    command += ["--kv-host-memory", "512MB", *extra]
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.2)


def chat(url: str, key: dict[str, str], **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": TURN}], "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=key, timeout=120)


def cached(response: httpx.Response) -> int | str:
    if response.status_code != 200:
        return f"HTTP {response.status_code}"
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def probe(url: str) -> dict[str, Any]:
    first = chat(url, A, user="alice", session_id="s1")
    row: dict[str, Any] = {"prompt_tokens": first.json()["usage"]["prompt_tokens"]}
    row["A again: cached_tokens"] = cached(chat(url, A, user="alice", session_id="s1"))
    row["B as user alice: cached_tokens"] = cached(chat(url, B, user="alice", session_id="s1"))
    row["B as user bob: cached_tokens"] = cached(chat(url, B, user="bob"))
    chat(url, A, user="carol", session_id="c1", messages=[{"role": "user", "content": TURN[::-1]}])
    time.sleep(0.5)  # let the write-through reach the tiers
    deleted = httpx.delete(f"{url}/v1/sessions", params={"user": "alice"}, headers=B)
    row["B deletes user alice's sessions"] = f"HTTP {deleted.status_code} {deleted.text[:60]}"
    row["A again after that: cached_tokens"] = cached(chat(url, A, user="alice", session_id="s1"))
    carol = httpx.delete(f"{url}/v1/sessions/c1", params={"user": "carol"}, headers=B)
    row["B deletes session c1 of user carol (A's only)"] = f"HTTP {carol.status_code} {carol.text[:60]}"
    pushy = chat(url, B, priority=-1_000_000, service_tier="priority")
    row["B priority -1000000, service_tier priority"] = (
        f"HTTP {pushy.status_code}, ran as service_tier {pushy.json().get('service_tier', '-')!r}"
        if pushy.status_code == 200
        else f"HTTP {pushy.status_code}"
    )
    codes = [chat(url, B, max_tokens=1) for _ in range(10)]
    refused = next((r for r in codes if r.status_code == 429), None)
    row["B: 10 more requests"] = ", ".join(str(r.status_code) for r in codes)
    if refused is not None:
        keep = (
            "retry-after",
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        )
        row["B's 429 headers"] = {k: refused.headers.get(k) for k in keep}
    row["A meanwhile"] = f"HTTP {chat(url, A, max_tokens=1).status_code}"
    own = httpx.delete(f"{url}/v1/sessions/c1", params={"user": "carol"}, headers=A)
    row["A deletes session c1 of user carol"] = f"HTTP {own.status_code} {own.text[:70]}"
    row["A: 1-token request, median of 40 (ms)"] = round(latency(url), 1)
    return row


def latency(url: str, runs: int = 40) -> float:
    """Median milliseconds of a short chat request (1 new token) by tenant A: the door's cost next to the model's."""
    body = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 1, "temperature": 0}
    seconds = []
    with httpx.Client(timeout=60) as client:
        for _ in range(runs):
            started = time.perf_counter()
            assert client.post(f"{url}/v1/chat/completions", json=body, headers=A).status_code == 200
            seconds.append(time.perf_counter() - started)
    return sorted(seconds)[runs // 2] * 1000


def authenticate_cost(keys: int = 10_000, calls: int = 200) -> float:
    from serve.tenancy.tenants import parse_tenants

    text = "".join(f'[tenants.t{i}]\nkeys = ["key-{i:06d}-{"x" * 24}"]\n' for i in range(keys))
    tenants = parse_tenants(text, "generated")
    started = time.perf_counter()
    for index in range(calls):
        tenants.authenticate(f"key-{index:06d}-{'x' * 24}".encode())
    return (time.perf_counter() - started) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--out", default="runs/tenant-probe.json")
    args = parser.parse_args()
    from serve.http import free_port

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tenants.toml"
        path.write_text(TENANTS)
        for name, extra in (
            ("two --api-key (one tenant)", ["--api-key", "key-tenant-a", "--api-key", "key-tenant-b"]),
            ("--tenants (two tenants)", ["--tenants", str(path)]),
        ):
            port = free_port()
            proc = start(args.artifact, extra, port)
            try:
                results[name] = probe(f"http://127.0.0.1:{port}")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            warnings = [
                line
                for line in (proc.stderr.read() if proc.stderr else "").splitlines()
                if "one tenant" in line
            ]
            results[name]["start-up warning"] = warnings[0] if warnings else "-"
    results["authenticate, 10,000 keys (ms per call)"] = round(authenticate_cost(), 3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
