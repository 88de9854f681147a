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


def test_sigterm_drains_running_requests(tiny_llama: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "qpack",
        "serve",
        str(tiny_llama),
        "--port",
        str(port),
        "--kv-memory",
        "16MB",
        "--block-size",
        "4",
        "--kv-dtype",
        "bfloat16",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a first start on a machine builds the native kernels (~1 min)
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (
                proc.stderr.read() if proc.poll() is not None else ""
            )
            time.sleep(0.1)
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
