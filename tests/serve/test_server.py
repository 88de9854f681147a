"""`qpack serve` as users run it: a subprocess, loopback, SIGTERM drains running requests before exiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from serve.http import free_port


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """`qpack serve ARGS` on a free port, once it answers /health (a first start on a machine builds the native
    kernels, ~1 min)."""
    port = free_port()
    command = [sys.executable, "-m", "qpack", "serve", *args, "--port", str(port), "--kv-memory", "16MB"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, (
            proc.stderr.read() if proc.poll() is not None else ""
        )
        time.sleep(0.1)


def test_sigterm_drains_running_requests(tiny_llama: Path) -> None:
    proc, url = _start([str(tiny_llama), "--block-size", "4", "--kv-dtype", "bfloat16"])
    try:
        chunks: list[str] = []
        payload = {
            "prompt": "Once upon a time",
            "max_tokens": 300,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as response:
                chunks.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert chunks and chunks[-1] == "data: [DONE]"
        finals = [json.loads(c[6:]) for c in chunks[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        banner = proc.stderr.read()
        assert "KV cache:" in banner and "MiB bfloat16" in banner
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sighup_reloads_tenants_and_a_broken_file_keeps_the_old_ones(
    tiny_llama: Path, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\nkeys = ["key-a"]\ntier = "priority"\n')
    proc, url = _start([str(tiny_llama), "--tenants", str(tenants), "--block-size", "4"])
    a, c = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-c"}
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    try:
        assert httpx.post(f"{url}/v1/completions", json=body, headers=a, timeout=60).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body, headers=c, timeout=60).status_code == 401
        chunks: list[str] = []
        long = {**body, "max_tokens": 200, "stream": True, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=a, timeout=120) as response:
                chunks.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.3)
        tenants.write_text('[tenants.acme]\nkeys = ["key-a"]\ntier = "gold"\n')
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert httpx.post(f"{url}/v1/completions", json=body, headers=a, timeout=60).status_code == 200
        tenants.write_text('[tenants.initech]\nkeys = ["key-c"]\n')
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while httpx.post(f"{url}/v1/completions", json=body, headers=c, timeout=60).status_code != 200:
            assert time.monotonic() < deadline, "the reload never took"
            time.sleep(0.1)
        assert httpx.post(f"{url}/v1/completions", json=body, headers=a, timeout=60).status_code == 401
        reader.join(timeout=120)
        assert chunks[-1] == "data: [DONE]"  # the stream admitted under the old file ran to its end
        assert json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'qpack_tenants_reloads_total{outcome="failed"} 1.0' in metrics
        assert 'qpack_tenants_reloads_total{outcome="ok"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    log = proc.stderr.read()  # type: ignore[union-attr]
    assert "tenants not reloaded" in log and "line 3: tenants.acme.tier must be one of" in log
    assert "tenants reloaded" in log and "key-a" not in log and "key-c" not in log


def test_a_malformed_tenants_file_is_refused_at_start_naming_the_line(
    tiny_llama: Path, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\nkeys = ["key-a"]\nrequests_per_minute = "lots"\n')
    run = subprocess.run(
        [sys.executable, "-m", "qpack", "serve", str(tiny_llama), "--tenants", str(tenants)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "line 3: tenants.acme.requests_per_minute must be a number" in lines[0]
