"""Load generator for OpenAI-compatible servers: fixed concurrency or Poisson arrivals, streaming timings.

Each request streams (`stream: true`), so time to first token (TTFT), time per output token (TPOT) and
end-to-end latency are measured from the client side, as a user would see them. Runs are bounded in request
count *and* wall time; requests still running at the deadline are cancelled and reported as unfinished, never
as errors. Errors (HTTP status >= 400, broken streams) are counted, not raised. Optional random client aborts
(closing the stream part-way) exercise the server's cleanup. Loopback/test hosts only: the URL is the caller's.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[dict[str, str]]  # completion text, or chat messages
    max_tokens: int
    prompt_tokens: int = 0


@dataclass
class RequestResult:
    ok: bool
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    aborted: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelResult:
    label: str
    duration: float
    results: list[RequestResult] = field(default_factory=list)
    unfinished: int = 0

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.results if r.ok and not r.aborted]
        e2e = [r.e2e for r in done if r.e2e is not None]
        ttft = [r.ttft for r in done if r.ttft is not None]
        tpot = [t for r in done if (t := r.tpot) is not None]
        tokens = sum(r.output_tokens for r in self.results if r.ok)
        stats = lambda xs: {  # noqa: E731
            "avg": sum(xs) / len(xs) if xs else math.nan,
            "p50": percentile(xs, 50),
            "p95": percentile(xs, 95),
            "p99": percentile(xs, 99),
        }
        return {
            "label": self.label,
            "completed": len(done),
            "aborted": sum(r.aborted for r in self.results),
            "errors": sum(not r.ok for r in self.results),
            "unfinished": self.unfinished,
            "duration_s": self.duration,
            "requests_per_s": len(done) / self.duration if self.duration else 0.0,
            "output_tokens_per_s": tokens / self.duration if self.duration else 0.0,
            "e2e_s": stats(e2e),
            "ttft_s": stats(ttft),
            "tpot_s": stats(tpot),
            "error_samples": [r.error for r in self.results if not r.ok][:5],
        }


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    request: BenchRequest,
    abort_after: int | None = None,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    chat = not isinstance(request.prompt, str)
    body: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    body["messages" if chat else "prompt"] = request.prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    started = time.perf_counter()
    result = RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", url + path, json=body) as response:
            result.status = response.status_code
            if response.status_code >= 400:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if event.get("usage"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
                choices = event.get("choices") or []
                text = (
                    choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                    if choices
                    else None
                )
                if text and result.ttft is None:
                    result.ttft = time.perf_counter() - started
                if text:
                    chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        result.aborted = True
                        result.ok = True
                        return result
        result.e2e = time.perf_counter() - started
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_level(
    url: str,
    requests: list[BenchRequest],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    max_seconds: float = 300.0,
    abort_fraction: float = 0.0,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> LevelResult:
    """Send `requests` at fixed `concurrency` or Poisson `rate` (req/s); stop at `max_seconds`."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency or rate")
    rng = random.Random(seed)
    label = f"concurrency {concurrency}" if concurrency is not None else f"rate {rate}/s"
    level = LevelResult(label=label, duration=0.0)
    limits = httpx.Limits(
        max_connections=(concurrency or 1000) + 4, max_keepalive_connections=(concurrency or 64) + 4
    )
    timeout = httpx.Timeout(max_seconds + 30, connect=10)
    started = time.perf_counter()
    deadline = started + max_seconds
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        tasks: list[asyncio.Task[RequestResult | None]] = []
        aborts = [
            rng.randint(1, max(2, r.max_tokens // 2)) if rng.random() < abort_fraction else None
            for r in requests
        ]

        async def start(index: int) -> RequestResult | None:
            if time.perf_counter() > deadline:
                return None  # never sent: unfinished, not an error
            return await one_request(client, url, requests[index], aborts[index], extra)

        if concurrency is not None:
            semaphore = asyncio.Semaphore(concurrency)

            async def worker(index: int) -> RequestResult | None:
                async with semaphore:
                    return await start(index)

            tasks = [asyncio.create_task(worker(i)) for i in range(len(requests))]
        else:
            assert rate is not None
            for index in range(len(requests)):
                if time.perf_counter() > deadline:
                    break
                tasks.append(asyncio.create_task(start(index)))
                await asyncio.sleep(rng.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        level.duration = time.perf_counter() - started
        level.unfinished = len(pending) + (len(requests) - len(tasks))
        for task in done:
            result = task.result()
            if result is None:
                level.unfinished += 1
            else:
                level.results.append(result)
    return level
