"""Fair share inside a tier (issue 43): tenant B keeps `--backlog` requests queued or running with `"priority":
-1000000`, in tenant A's tier, and A sends one short greedy request at a time. A's time to its answer is compared
with the same request on the idle server, measured in the same run. Target: at most 3x.

    python benchmarks/fair_share.py [MODEL_OR_ARTIFACT] [--out runs/fair-share.json] [--baseline-server "CMD ..."]

`--baseline-server` names another command that starts a server the same way, to measure what the fix changed
in the same run: an older checkout's, e.g. `env PYTHONPATH=../old python -P -m qpack serve` (`-P`: the current
directory's `qpack` must not shadow it). A request of A that has not finished after `--patience` seconds counts as
that many (starved). The server is started
with `--max-num-seqs 8`: B's backlog is far more than one batch, as it is when a tenant floods a real server.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from qpack.bench.serving import ServerProcess

TENANTS = """\
[tenants.acme]
keys = ["key-tenant-a"]
tier = "standard"

[tenants.globex]
keys = ["key-tenant-b"]
tier = "standard"
"""
A, B = {"Authorization": "Bearer key-tenant-a"}, {"Authorization": "Bearer key-tenant-b"}
A_BODY = {
    "messages": [{"role": "user", "content": "Write one short sentence about a cat."}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}
B_BODY = {
    "messages": [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}],
    "max_tokens": 64,
    "temperature": 0,
    "ignore_eos": True,
    "priority": -1_000_000,
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def start(command: list[str], port: int, tenants: Path) -> ServerProcess:
    full = [*command, "--port", str(port), "--tenants", str(tenants), "--max-num-seqs", "8"]
    server = ServerProcess(full, port, command[-1])
    server.wait_ready()
    return server


def timed_a(client: httpx.Client, url: str, patience: float) -> float:
    """Seconds to A's whole answer; `patience` (recorded as such) when it has not come by then."""
    began = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/chat/completions", json=A_BODY, headers=A, timeout=patience)
    except httpx.TimeoutException:
        return patience
    response.raise_for_status()
    return time.perf_counter() - began


def flood(url: str, backlog: int, stop: threading.Event, counts: dict[str, int]) -> list[threading.Thread]:
    """`backlog` threads, each sending B's request again as soon as its last one ends."""

    def one() -> None:
        with httpx.Client(timeout=600) as client:
            while not stop.is_set():
                response = client.post(f"{url}/v1/chat/completions", json=B_BODY, headers=B)
                key = str(response.status_code)
                counts[key] = counts.get(key, 0) + 1

    threads = [threading.Thread(target=one, daemon=True) for _ in range(backlog)]
    for thread in threads:
        thread.start()
    return threads


def measure(url: str, backlog: int, runs: int, patience: float) -> dict[str, Any]:
    with httpx.Client(timeout=600) as client:
        timed_a(client, url, patience)  # warm-up
        idle = [timed_a(client, url, patience) for _ in range(runs)]
        stop = threading.Event()
        counts: dict[str, int] = {}
        threads = flood(url, backlog, stop, counts)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health").json().get("waiting", 0) + 8 < backlog:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        health = httpx.get(f"{url}/health").json()
        loaded = [timed_a(client, url, patience) for _ in range(runs)]
        stop.set()
    for thread in threads:
        thread.join(timeout=600)
    ratio = statistics.median(loaded) / statistics.median(idle)
    return {
        "idle_s": [round(s, 3) for s in idle],
        "loaded_s": [round(s, 3) for s in loaded],
        "idle_median_s": round(statistics.median(idle), 3),
        "loaded_median_s": round(statistics.median(loaded), 3),
        "loaded_max_s": round(max(loaded), 3),
        "ratio_median": round(ratio, 2),
        "ratio_worst": round(max(loaded) / statistics.median(idle), 2),
        "b_running_waiting_when_a_sent": [health.get("running"), health.get("waiting")],
        "b_statuses": counts,
        "a_timed_out": sum(s >= patience for s in loaded),
        "target_met": max(loaded) / statistics.median(idle) <= 3.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", nargs="?", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path("runs/fair-share.json"))
    parser.add_argument("--backlog", type=int, default=48)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument(
        "--patience", type=float, default=30.0, help="seconds A waits before it counts as starved"
    )
    parser.add_argument(
        "--baseline-server", default="", help="a command that starts the server to compare with"
    )
    args = parser.parse_args()
    results: dict[str, Any] = {"cpu": cpu_name(), "backlog": args.backlog, "a": A_BODY, "b": B_BODY}
    servers = {"this": [sys.executable, "-m", "qpack", "serve", args.target]}
    if args.baseline_server:
        servers["baseline"] = [*shlex.split(args.baseline_server), args.target]
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(TENANTS)
        for name, command in servers.items():
            server = start(command, args.port, tenants)
            try:
                results[name] = measure(server.url, args.backlog, args.runs, args.patience)
            finally:
                server.stop()
            print(name, json.dumps(results[name]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
