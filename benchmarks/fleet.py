"""The fleet against one process: the same ShareGPT replay through a Redis gateway and workers, under faults.

Every request is a real ShareGPT first user turn (chat endpoint, streamed, sampled at temperature 0.8 with its
own seed = its index, `--max-tokens` at most), so each answer has exactly one right text: the single-process
server's for that seed. Runs, each on fresh processes and a fresh `redis-server` (started here on a free port):

1. `single`: `qpack serve ART --threads 2` (the baseline, and the reference answers).
2. `fleet`: `qpack serve ART --role all --workers 2` (a gateway and two 1-thread workers): throughput and TTFT
   against `single`, and Redis's own cost per request (commands, microseconds of Redis CPU, bytes) from INFO.
3. `overhead`: what the gateway and Redis add to a request's TTFT: `--overhead-requests` requests one at a
   time, alternating between a single server and a gateway + one worker with the same 2 threads.
4. `chaos`: a gateway and two worker processes; every `--kill-every` seconds one worker is SIGKILLed and a new
   one started; the survivor continues the dead worker's answers. Counts lost (no answer), malformed (a stream
   that does not parse or end with [DONE]), and answers that differ from `single` (compare with `fleet`'s
   count, which has no faults: prefill GEMMs are not batch-invariant, so a few answers sampled at T=0.8
   diverge late even without faults).
5. `redis-restart`: `redis-server` with AOF, stopped and started again mid-run: no request may run past its
   deadline (`--request-timeout`), and the fleet must answer again afterwards.

    python benchmarks/fleet.py out/perf/int8 --out out/fleet
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qpack.bench.loadgen import percentile  # noqa: E402
from serve.fleet.local_redis import LocalRedis  # noqa: E402
from serve.http import free_port  # noqa: E402


class Process:
    """A `qpack serve` subprocess logging to a file; ready when /health says so (and `workers` are live)."""

    def __init__(self, args: list[str], log: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "qpack", "serve", *args, "--port", str(self.port)]
        self.handle = open(log, "a")  # noqa: SIM115 - closed in stop()
        self.handle.write(f"\n$ {' '.join(command)}\n")
        self.handle.flush()
        self.process = subprocess.Popen(
            command, stdout=self.handle, stderr=self.handle, start_new_session=True
        )

    def wait_ready(self, workers: int = 0, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.url} exited {self.process.returncode}; see {self.handle.name}")
            try:
                response = httpx.get(self.url + "/health", timeout=2)
                if response.status_code == 200 and response.json().get("workers", 0) >= workers:
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.25)
        raise SystemExit(f"{self.url} did not become ready; see {self.handle.name}")

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()
        self.handle.close()


def requests_for(artifact: Path, count: int, max_tokens: int) -> list[dict[str, Any]]:
    from qpack.bench.serving import sharegpt_requests
    from quantize.model.sources import load_tokenizer

    tokenizer = load_tokenizer(artifact)
    picked = sharegpt_requests(tokenizer, count, max_prompt=384, max_output=max_tokens, seed=0)
    return [
        {
            "messages": r.prompt,
            "max_tokens": r.max_tokens,
            "temperature": 0.8,
            "seed": index,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for index, r in enumerate(picked)
    ]


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: its text, TTFT, tokens, and whether the stream was well formed."""
    started = time.perf_counter()
    result: dict[str, Any] = {"ok": False, "malformed": False, "text": "", "ttft": None, "tokens": 0}
    pieces: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            result["status"] = response.status_code
            if response.status_code != 200:
                result["error"] = (await response.aread())[:300].decode(errors="replace")
                result["e2e"] = time.perf_counter() - started
                return result
            done = finish = False
            async for line in response.aiter_lines():
                if not line:
                    continue
                if done or not line.startswith("data: "):
                    result["malformed"] = True
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    result["tokens"] = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        result["ttft"] = result["ttft"] or time.perf_counter() - started
                        pieces.append(content)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
            result["ok"] = done and finish not in (False, "error")
            result["finish_reason"] = finish
            result["malformed"] = result["malformed"] or not done
    except json.JSONDecodeError:
        result["malformed"] = True
    except httpx.HTTPError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["text"] = "".join(pieces)
    result["e2e"] = time.perf_counter() - started
    return result


def replay(url: str, bodies: list[dict[str, Any]], concurrency: int, timeout: float) -> dict[str, Any]:
    async def run() -> tuple[list[dict[str, Any]], float]:
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10)) as client:
            semaphore = asyncio.Semaphore(concurrency)

            async def one(body: dict[str, Any]) -> dict[str, Any]:
                async with semaphore:
                    return await stream_one(client, url, body)

            started = time.perf_counter()
            results = await asyncio.gather(*(one(b) for b in bodies))
            return list(results), time.perf_counter() - started

    results, duration = asyncio.run(run())
    return {"results": results, "duration": duration}


def summary(run: dict[str, Any], reference: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    results = run["results"]
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "lost": sum(not r["ok"] for r in results),
        "malformed": sum(r["malformed"] for r in results),
        "duration_s": round(run["duration"], 2),
        "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / run["duration"], 1),
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1),
        "ttft_p95_ms": round(1000 * percentile(ttft, 95), 1),
        "e2e_max_s": round(max((r["e2e"] for r in results), default=0.0), 2),
        "statuses": sorted({r.get("status", 0) for r in results}),
        "errors": [r["error"] for r in results if r.get("error")][:5],
    }
    if reference is not None:
        pairs = [(r, ref) for r, ref in zip(results, reference, strict=True) if r["ok"] and ref["ok"]]
        different = [(r, ref) for r, ref in pairs if r["text"] != ref["text"]]
        out["compared"] = len(pairs)
        out["different_from_single"] = len(different)
        out["first_difference_at_char"] = [_first_difference(r["text"], ref["text"]) for r, ref in different][
            :10
        ]
    return out


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def redis_cost(before: dict[str, Any], after: dict[str, Any], requests: int) -> dict[str, Any]:
    """Redis's work per request from two `INFO all` snapshots: commands, CPU microseconds, bytes in and out."""

    def commands(info: dict[str, Any]) -> tuple[int, float]:
        stats = [v for k, v in info.items() if k.startswith("cmdstat_")]
        return sum(int(s["calls"]) for s in stats), sum(float(s["usec"]) for s in stats)

    calls_before, usec_before = commands(before)
    calls_after, usec_after = commands(after)
    cpu = lambda i: float(i["used_cpu_sys"]) + float(i["used_cpu_user"])  # noqa: E731
    per_command = {
        key.removeprefix("cmdstat_"): (
            (int(stat["calls"]) - int(before.get(key, {}).get("calls", 0))) / requests,
            (float(stat["usec"]) - float(before.get(key, {}).get("usec", 0))) / requests,
        )
        for key, stat in after.items()
        if key.startswith("cmdstat_")
    }
    top = sorted(per_command.items(), key=lambda item: -item[1][1])[:8]
    return {
        "top_commands": {name: {"calls": round(c, 1), "usec": round(u, 1)} for name, (c, u) in top},
        "commands_per_request": round((calls_after - calls_before) / requests, 1),
        "command_usec_per_request": round((usec_after - usec_before) / requests, 1),
        "redis_cpu_ms_per_request": round(1000 * (cpu(after) - cpu(before)) / requests, 3),
        "bytes_in_per_request": round(
            (after["total_net_input_bytes"] - before["total_net_input_bytes"]) / requests
        ),
        "bytes_out_per_request": round(
            (after["total_net_output_bytes"] - before["total_net_output_bytes"]) / requests
        ),
    }


def run_single(artifact: Path, bodies: list[dict[str, Any]], args: argparse.Namespace, log: Path) -> dict:
    server = Process([str(artifact), "--threads", "2", *args.engine], log)
    try:
        server.wait_ready()
        replay(server.url, bodies[:8], args.concurrency, args.request_timeout)  # warm-up
        return replay(server.url, bodies, args.concurrency, args.request_timeout)
    finally:
        server.stop()


def run_fleet(artifact: Path, bodies: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> tuple:
    import redis

    with LocalRedis(out / "redis-fleet") as queue:
        server = Process(
            [str(artifact), "--role", "all", "--workers", "2", "--redis", queue.url, *args.engine],
            out / "fleet.log",
        )
        try:
            server.wait_ready(workers=2)
            replay(server.url, bodies[:8], args.concurrency, args.request_timeout)
            client = redis.Redis.from_url(queue.url)
            before = client.info("all")
            run = replay(server.url, bodies, args.concurrency, args.request_timeout)
            cost = redis_cost(before, client.info("all"), len(bodies))
        finally:
            server.stop()
    return run, cost


def run_overhead(artifact: Path, bodies: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> dict:
    """What the gateway and Redis add to one request: the same `--overhead-requests` requests one at a time,
    alternating between a single server and a gateway in front of one worker with the same 2 threads."""
    sample = [{**b, "max_tokens": 8} for b in bodies[: args.overhead_requests]]
    with LocalRedis(out / "redis-overhead") as queue:
        single = Process([str(artifact), "--threads", "2", *args.engine], out / "overhead.log")
        gateway = Process(["--role", "gateway", "--redis", queue.url], out / "overhead.log")
        worker = Process(
            [str(artifact), "--role", "worker", "--redis", queue.url, "--threads", "2", *args.engine],
            out / "overhead.log",
        )
        try:
            single.wait_ready()
            gateway.wait_ready(workers=1)
            ttft: dict[str, list[float]] = {"single": [], "fleet": []}
            for body in sample[:2] + sample:  # the first two warm both up
                for name, url in (("single", single.url), ("fleet", gateway.url)):
                    result = replay(url, [body], 1, args.request_timeout)["results"][0]
                    if result["ttft"] is not None:
                        ttft[name].append(result["ttft"])
        finally:
            for process in (single, gateway, worker):
                process.stop()
    p50 = {name: 1000 * percentile(values[2:], 50) for name, values in ttft.items()}
    return {
        "requests": len(sample),
        "ttft_p50_ms": {name: round(value, 1) for name, value in p50.items()},
        "ttft_p50_overhead_ms": round(p50["fleet"] - p50["single"], 1),
    }


def run_chaos(artifact: Path, bodies: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> tuple:
    """Gateway + 2 workers; one worker SIGKILLed and replaced every `--kill-every` seconds."""
    with LocalRedis(out / "redis-chaos") as queue:
        fleet = ["--redis", queue.url, "--claim-idle", str(args.claim_idle)]
        fleet += ["--request-timeout", str(args.request_timeout)]
        gateway = Process(["--role", "gateway", *fleet], out / "chaos.log")
        worker_args = [str(artifact), "--role", "worker", "--threads", "1", *fleet, *args.engine]
        workers = [Process(worker_args, out / "chaos.log") for _ in range(2)]
        kills: list[float] = []
        stop = threading.Event()

        def killer() -> None:
            index = 0
            while not stop.wait(args.kill_every):
                workers[index % 2].kill()
                kills.append(time.monotonic())
                workers[index % 2] = Process(worker_args, out / "chaos.log")
                index += 1

        try:
            gateway.wait_ready(workers=2)
            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            run = replay(gateway.url, bodies, args.concurrency, args.request_timeout)
            stop.set()
            thread.join()
            metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        finally:
            stop.set()
            for process in [gateway, *workers]:
                process.stop()
    regenerated = [
        line for line in metrics.splitlines() if line.startswith("qpack_fleet_regenerations_total")
    ]
    return run, {"kills": len(kills), "regenerations": regenerated}


def run_redis_restart(
    artifact: Path, bodies: list[dict[str, Any]], args: argparse.Namespace, out: Path
) -> tuple:
    """AOF on; Redis stopped for `--redis-down` seconds a third of the way through the replay."""
    with LocalRedis(out / "redis-aof", appendonly=True) as queue:
        server = Process(
            [
                str(artifact),
                "--role",
                "all",
                "--workers",
                "2",
                "--redis",
                queue.url,
                "--request-timeout",
                str(args.request_timeout),
                *args.engine,
            ],
            out / "redis-restart.log",
        )
        try:
            server.wait_ready(workers=2)
            restart = threading.Timer(args.restart_after, lambda: queue.restart(down_for=args.redis_down))
            restart.start()
            run = replay(server.url, bodies, args.concurrency, args.request_timeout + 30)
            restart.join()
            time.sleep(2)
            after = replay(server.url, bodies[:10], 5, args.request_timeout)
        finally:
            server.stop()
    return run, summary(after)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, default=Path("out/fleet"))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill-every", type=float, default=45.0)
    parser.add_argument("--claim-idle", type=float, default=3.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--restart-after", type=float, default=15.0)
    parser.add_argument("--redis-down", type=float, default=2.0)
    parser.add_argument("--overhead-requests", type=int, default=40)
    parser.add_argument("--runs", default="single,fleet,overhead,chaos,redis-restart")
    args = parser.parse_args()
    args.engine = ["--kv-memory", "256MB", "--max-num-seqs", "32"]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.runs.split(",")
    bodies = requests_for(args.artifact, args.requests, args.max_tokens)
    report: dict[str, Any] = {"requests": len(bodies), "concurrency": args.concurrency, "cpu": _cpu()}
    print(f"{len(bodies)} ShareGPT requests at concurrency {args.concurrency}", flush=True)
    single = run_single(args.artifact, bodies, args, args.out / "single.log")
    report["single"] = summary(single)
    print("single", json.dumps(report["single"]), flush=True)
    reference = single["results"]
    if "fleet" in runs:
        fleet, cost = run_fleet(args.artifact, bodies, args, args.out)
        report["fleet"] = {**summary(fleet, reference), "redis": cost}
        report["fleet_vs_single"] = {
            "throughput_ratio": round(
                report["fleet"]["output_tokens_per_s"] / report["single"]["output_tokens_per_s"], 3
            ),
            "ttft_p50_overhead_ms": round(
                report["fleet"]["ttft_p50_ms"] - report["single"]["ttft_p50_ms"], 1
            ),
        }
        print("fleet", json.dumps(report["fleet"]), json.dumps(report["fleet_vs_single"]), flush=True)
    if "overhead" in runs:
        report["overhead"] = run_overhead(args.artifact, bodies, args, args.out)
        print("overhead", json.dumps(report["overhead"]), flush=True)
    if "chaos" in runs:
        chaos, faults = run_chaos(args.artifact, bodies, args, args.out)
        report["chaos"] = {**summary(chaos, reference), **faults}
        print("chaos", json.dumps(report["chaos"]), flush=True)
    if "redis-restart" in runs:
        restart, after = run_redis_restart(args.artifact, bodies, args, args.out)
        report["redis_restart"] = {
            **summary(restart, reference),
            "deadline_s": args.request_timeout,
            "after_restart": after,
        }
        print("redis-restart", json.dumps(report["redis_restart"]), flush=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'results.json'}")


def _cpu() -> str:
    from qpack.bench.sysinfo import machine_info

    info = machine_info()
    return str(info.get("cpu") or info)[:200]


if __name__ == "__main__":
    main()
