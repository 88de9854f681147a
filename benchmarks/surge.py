"""A promotion's traffic surge against `qpack serve`: static configurations against the surge controller, with and
without precision routing, on one server or a fleet, in one sitting.

    python benchmarks/surge.py out/int8 --variant out/int4 --out runs/surge [--fleet] [--scale 0.5]

1. **Capacity.** The throughput configuration at a fixed concurrency of 32 for `--capacity-seconds`: completed
   requests a second is the machine's capacity C for this request mix; one request at a time gives the unloaded
   TTFT, TPOT and service time.
2. **The trace.** Poisson arrivals at 0.4 C for 60 s, rising to `--peak` x C within 10 s, held 120 s, back to 0.4 C
   for 40 s (times x `--scale`); tiers drawn 10% priority, 60% standard, 30% free, each a tenant of its own
   with its tier's SLO (by default from step 1: a first token within max(1.5 s, 6 x the unloaded TTFT) for
   priority, 2.5x that for standard, 6x for free; tokens every 2 x the loaded TPOT, 1.5x, 2.5x); ShareGPT
   first user turns, up to `--max-tokens` tokens each. The same arrivals go to every run. Standard and free
   may be routed to a variant within 1.5x the variant's measured KL; priority never.
3. **Runs**, each on a fresh server: (a) a static latency configuration (a small batch and prefill chunks),
   (b) a static throughput configuration (`--max-num-seqs 32`), (c1) (b) with a batching window of the
   average latency x 1.5, (c2) (b) with a window of the average processing time / 2 (the design's two static
   rules, from step 1's measurements), (d) `--control`, (e) `--control` with `--variant` served beside (on a
   fleet the workers take the builds in turn), (e2) on a fleet, (e) with every worker process holding both
   builds (`--worker-variants all`).
4. **Per run and tier**: SLO attainment (met / served, and met / all that asked), goodput (met requests a
   second), shed (429 from the controller), refused (429 queue full), lost (no answer: errors, timeouts), TTFT
   p50/p95/p99, TPOT p50/p95; tokens a second overall and during the surge; the share each variant served and
   its quality cost (share x the variant's measured KL); the controller's mode switches and when it first acted
   after the rise. A PNG timeline per run: arrivals and forecast, queue, mode and shed level, variant share,
   rolling p95 TTFT per tier.

Results: `OUT/surge.json`, `OUT/surge.md`, `OUT/timeline-RUN.png`, server logs. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleet import Process  # noqa: E402

from qpack.bench.loadgen import percentile  # noqa: E402
from serve.fleet.local_redis import LocalRedis  # noqa: E402

TIERS = ("priority", "standard", "free")
MIX = (0.1, 0.6, 0.3)
KEYS = {tier: f"surge-key-{tier}" for tier in TIERS}


@dataclass(frozen=True)
class Arrival:
    at: float
    tier: str
    index: int  # which request of the mix


@dataclass
class Outcome:
    tier: str
    at: float
    end: float | None = None  # seconds into the trace when its last byte came
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    variant: str | None = None
    code: str | None = None
    error: str | None = None


@dataclass
class Sample:
    at: float
    values: dict[str, float] = field(default_factory=dict)


def trace(capacity: float, peak: float, scale: float, seed: int, count: int) -> list[Arrival]:
    """Poisson arrivals of the promotion (thinning a non-homogeneous process), tiers drawn from MIX."""
    base, top = 0.4 * capacity, peak * capacity
    phases = (60 * scale, 10 * scale, 120 * scale, 40 * scale)
    end = sum(phases)

    def rate(t: float) -> float:
        rise, hold = phases[0], phases[0] + phases[1]
        if t < rise or t >= hold + phases[2]:
            return base
        return top if t >= hold else base + (top - base) * (t - rise) / phases[1]

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return arrivals
        if rng.random() < rate(t) / top:
            tier = rng.choices(TIERS, MIX)[0]
            arrivals.append(Arrival(t, tier, rng.randrange(count)))


def tenants_file(path: Path, ttft: list[float], tpot: list[float], free_kl: float | None) -> Path:
    lines = []
    for (tier, service), first, each in zip(
        (("priority", "priority"), ("standard", "default"), ("free", "flex")), ttft, tpot, strict=True
    ):
        lines += ["[[tiers]]", f'name = "{tier}"', f'service_tier = "{service}"']
        lines += [f"ttft_ms = {first * 1000:.0f}", f"tpot_ms = {each * 1000:.0f}"]
        if tier == "priority":
            lines.append("max_kl = 0.0")
        elif free_kl is not None:
            lines.append(f"max_kl = {free_kl}")  # standard and free may run on a build within this KL
        lines.append("")
    for tier in TIERS:
        lines += [f"[tenants.{tier}-co]", f'keys = ["{KEYS[tier]}"]', f'tier = "{tier}"', ""]
    path.write_text("\n".join(lines))
    return path


async def one(
    client: httpx.AsyncClient, url: str, arrival: Arrival, body: dict[str, Any], t0: float
) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + arrival.at - time.perf_counter()))
    outcome = Outcome(arrival.tier, arrival.at)
    started = time.perf_counter()
    first = last = None
    try:
        headers = {"Authorization": f"Bearer {KEYS[arrival.tier]}"}
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            outcome.status = response.status_code
            outcome.variant = response.headers.get("x-qpack-variant")
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                try:
                    outcome.code = json.loads(text)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    outcome.error = text[:200]
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    outcome.tokens = int(event["usage"]["completion_tokens"])
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                if choices and choices[0].get("finish_reason") == "error":
                    outcome.error = "stream ended with an error"
    except (httpx.HTTPError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    outcome.end = time.perf_counter() - t0
    if first is not None:
        outcome.ttft = first - started
        if outcome.tokens > 1 and last is not None:
            outcome.tpot = (last - first) / (outcome.tokens - 1)
    return outcome


async def replay(url: str, arrivals: list[Arrival], requests: list[dict[str, Any]]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(180, connect=30)) as client:
        t0 = time.perf_counter() + 0.5
        tasks = [asyncio.create_task(one(client, url, a, requests[a.index], t0)) for a in arrivals]
        return list(await asyncio.gather(*tasks))


def watch(url: str, stop: threading.Event, samples: list[Sample], t0: float) -> None:
    """Scrape /metrics every half second: the controller's state, queue, variant counters."""
    wanted = (
        "qpack_control_mode",
        "qpack_control_forecast_rps",
        "qpack_control_shed_from_rank",
        "qpack_control_shed_share",
        "qpack_control_capacity_rps",
        "qpack_queue_depth",
        "qpack_running_requests",
        "qpack_variant_requests_total",
        "qpack_fleet_control_mode",
        "qpack_fleet_control_forecast_rps",
        "qpack_fleet_control_shed_from_rank",
        "qpack_fleet_control_shed_share",
        "qpack_fleet_control_capacity_rps",
        "qpack_fleet_queue_depth",
        "qpack_fleet_variant_requests_total",
    )
    with httpx.Client(timeout=5) as client:
        while not stop.wait(0.5):
            try:
                text = client.get(url + "/metrics").text
            except httpx.HTTPError:
                continue
            sample = Sample(time.perf_counter() - t0)
            for line in text.splitlines():
                if line.startswith(wanted):
                    name, _, value = line.rpartition(" ")
                    name = re.sub(r'model="[^"]*",?', "", name).replace("{}", "")  # a gateway's one model
                    try:
                        sample.values[name] = sample.values.get(name, 0.0) + float(value)
                    except ValueError:
                        continue
            samples.append(sample)


def run_one(
    name: str,
    args: list[str],
    arrivals: list[Arrival],
    requests: list[dict[str, Any]],
    out: Path,
    workers: int,
) -> dict[str, Any]:
    server = Process(args, out / f"server-{name}.log")
    try:
        server.wait_ready(workers=workers)
        samples: list[Sample] = []
        stop = threading.Event()
        t0 = time.perf_counter() + 0.5
        watcher = threading.Thread(target=watch, args=(server.url, stop, samples, t0), daemon=True)
        watcher.start()
        outcomes = asyncio.run(replay(server.url, arrivals, requests))
        stop.set()
        watcher.join(timeout=5)
    finally:
        server.stop()
    return {"outcomes": [asdict(o) for o in outcomes], "samples": [asdict(s) for s in samples]}


def summarize(
    outcomes: list[dict[str, Any]],
    slo: dict[str, tuple[float, float]],
    window: tuple[float, float],
    kl: dict[str, float],
) -> dict[str, Any]:
    """Per tier and overall: attainment, goodput, shed, refused, lost, latency percentiles; tokens/s; variants."""
    end = max((o["at"] for o in outcomes), default=1.0)
    tiers: dict[str, Any] = {}
    for tier in TIERS:
        mine = [o for o in outcomes if o["tier"] == tier]
        served = [o for o in mine if o["status"] == 200 and o["error"] is None]
        first_limit, each_limit = slo[tier]
        met = [
            o
            for o in served
            if o["ttft"] is not None
            and o["ttft"] <= first_limit
            and (o["tpot"] is None or o["tpot"] <= each_limit)
        ]
        ttft = [o["ttft"] for o in served if o["ttft"] is not None]
        tpot = [o["tpot"] for o in served if o["tpot"] is not None]
        tiers[tier] = {
            "asked": len(mine),
            "served": len(served),
            "attainment": len(met) / len(served) if served else math.nan,
            "met_of_asked": len(met) / len(mine) if mine else math.nan,
            "goodput_rps": len(met) / end,
            "shed": sum(o["status"] == 429 and o["code"] == "overloaded" for o in mine),
            "refused": sum(o["status"] == 429 and o["code"] != "overloaded" for o in mine),
            "lost": sum(o["status"] != 429 and (o["status"] != 200 or o["error"] is not None) for o in mine),
            "ttft_s": {q: percentile(ttft, q) for q in (50, 95, 99)},
            "tpot_s": {q: percentile(tpot, q) for q in (50, 95)},
        }
    served = [o for o in outcomes if o["status"] == 200 and o["end"] is not None]
    finish = max((o["end"] for o in served), default=end)
    shares: dict[str, int] = {}
    for o in served:
        if o["variant"]:
            shares[o["variant"]] = shares.get(o["variant"], 0) + 1
    total = sum(shares.values()) or 1
    return {
        "tiers": tiers,
        "goodput_rps": sum(t["goodput_rps"] for t in tiers.values()),
        "tokens_per_s": sum(o["tokens"] for o in served) / finish,
        "surge_tokens_per_s": _tokens_within(served, window) / max(1e-9, window[1] - window[0]),
        "variant_share": {v: n / total for v, n in shares.items()},
        "quality_cost_kl": sum(n / total * kl.get(v, 0.0) for v, n in shares.items()),
    }


def _tokens_within(outcomes: list[dict[str, Any]], window: tuple[float, float]) -> float:
    """Tokens generated inside `window`, each answer's tokens spread evenly from its first to its last byte."""
    total = 0.0
    for o in outcomes:
        if o["ttft"] is None or not o["tokens"]:
            continue
        start, stop = o["at"] + o["ttft"], o["end"]
        if stop <= start:
            total += o["tokens"] if window[0] <= stop < window[1] else 0
            continue
        overlap = max(0.0, min(stop, window[1]) - max(start, window[0]))
        total += o["tokens"] * overlap / (stop - start)
    return total


def controller_timing(
    samples: list[dict[str, Any]], rise_at: float, base: tuple[float, float], surge: tuple[float, float]
) -> dict[str, Any]:
    """When the controller last switched to throughput mode around the rise at `rise_at` (seconds after it;
    negative: ahead of it) and whether it was in throughput mode already when the rise began; how many mode
    switches it made while the rate was steady (the base load and the surge's plateau), and how often the shed
    level (the rank shed from) changed on the plateau."""
    modes = [
        (
            s["at"],
            s["values"].get(
                'qpack_control_mode{mode="throughput"}',
                s["values"].get('qpack_fleet_control_mode{mode="throughput"}'),
            ),
        )
        for s in samples
    ]
    modes = [(at, m) for at, m in modes if m is not None]
    if not modes:
        return {}
    calm = [
        at for at, m in modes if at <= rise_at + 30 and m == 0.0
    ]  # its last latency-mode moment near the rise
    since = calm[-1] if calm else rise_at - 10
    acted = next((at - rise_at for at, m in modes if at >= since and m == 1.0), None)
    at_rise = next((m for at, m in modes if at >= rise_at), None)

    def switches(window: tuple[float, float]) -> int:
        held = [m for at, m in modes if window[0] <= at < window[1]]
        return sum(a != b for a, b in itertools.pairwise(held))

    levels = [
        v
        for s in samples
        if surge[0] <= s["at"] < surge[1]
        for k, v in s["values"].items()
        if k.endswith("control_shed_from_rank")
    ]
    return {
        "acted_after_rise_s": acted,
        "throughput_at_rise": at_rise == 1.0,
        "switches_at_base": switches(base),
        "switches_on_plateau": switches(surge),
        "shed_level_changes_on_plateau": sum(a != b for a, b in itertools.pairwise(levels)),
    }


def timeline(name: str, result: dict[str, Any], out: Path, phases: tuple[float, float, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes, samples = result["outcomes"], result["samples"]
    end = max((o["at"] for o in outcomes), default=1.0)
    seconds = range(int(end) + 1)
    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True)
    arrivals = [sum(1 for o in outcomes if s <= o["at"] < s + 1) for s in seconds]
    axes[0].plot(list(seconds), arrivals, label="arrivals/s")
    forecast = [
        (s["at"], v) for s in samples for k, v in s["values"].items() if k.endswith("control_forecast_rps")
    ]
    if forecast:
        axes[0].plot(*zip(*forecast, strict=True), label="forecast/s")
    axes[0].legend()
    axes[0].set_ylabel("requests/s")
    queue = [(s["at"], sum(v for k, v in s["values"].items() if "queue_depth" in k)) for s in samples]
    if queue:
        axes[1].plot(*zip(*queue, strict=True))
    axes[1].set_ylabel("queued")
    mode = [
        (s["at"], v) for s in samples for k, v in s["values"].items() if k.endswith('mode{mode="throughput"}')
    ]
    shed = [
        (s["at"], v + s["values"].get(k.replace("shed_from_rank", "shed_share"), 1.0) - 1.0 if v >= 0 else v)
        for s in samples
        for k, v in s["values"].items()
        if k.endswith("shed_from_rank")
    ]
    if mode:
        axes[2].step(*zip(*mode, strict=True), label="throughput mode", where="post")
    if shed:
        axes[2].step(*zip(*shed, strict=True), label="shed level: rank - 1 + share (-1 none)", where="post")
    axes[2].legend()
    variants = sorted({o["variant"] for o in outcomes if o["variant"]})
    for variant in variants:
        share = [
            sum(1 for o in outcomes if s <= o["at"] < s + 5 and o["variant"] == variant)
            / max(1, sum(1 for o in outcomes if s <= o["at"] < s + 5 and o["variant"]))
            for s in seconds
        ]
        axes[3].plot(list(seconds), share, label=variant)
    axes[3].set_ylabel("variant share")
    if variants:
        axes[3].legend()
    for tier in TIERS:
        p95 = []
        for s in seconds:
            values = [
                o["ttft"]
                for o in outcomes
                if o["tier"] == tier and s - 10 <= o["at"] < s and o["ttft"] is not None
            ]
            p95.append(percentile(values, 95) if values else math.nan)
        axes[4].plot(list(seconds), p95, label=tier)
    axes[4].set_ylabel("p95 TTFT (10 s)")
    axes[4].set_yscale("log")
    axes[4].legend()
    for ax in axes:
        for at in phases:
            ax.axvline(at, color="grey", linestyle=":")
    axes[-1].set_xlabel("seconds")
    fig.suptitle(f"surge: {name}")
    fig.tight_layout()
    fig.savefig(out / f"timeline-{name}.png", dpi=80)
    plt.close(fig)


def capacity(
    artifact: str, common: list[str], requests: list[dict[str, Any]], seconds: float, out: Path
) -> dict[str, float]:
    """Completed requests/s at concurrency 32 (the throughput configuration), and one request at a time."""
    from qpack.bench.loadgen import BenchRequest, run_level

    server = Process([artifact, *common], out / "server-capacity.log")
    try:
        server.wait_ready()
        bench = [BenchRequest(r["messages"], r["max_tokens"]) for r in requests]
        alone = asyncio.run(run_level(server.url, bench[:8], concurrency=1, max_seconds=120))
        loaded = asyncio.run(run_level(server.url, bench * 4, concurrency=32, max_seconds=seconds))
    finally:
        server.stop()
    quiet, busy = alone.summary(), loaded.summary()
    return {
        "capacity_rps": busy["requests_per_s"],
        "capacity_tokens_per_s": busy["output_tokens_per_s"],
        "loaded_e2e_s": busy["e2e_s"]["avg"],
        "unloaded_ttft_s": quiet["ttft_s"]["p50"],
        "unloaded_tpot_s": quiet["tpot_s"]["p50"],
        "unloaded_e2e_s": quiet["e2e_s"]["avg"],
        "loaded_tpot_s": busy["tpot_s"]["p50"],
    }


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--variant", help="a cheaper build of the same model, for run (e)")
    parser.add_argument("--out", default="runs/surge")
    parser.add_argument(
        "--fleet", action="store_true", help="gateway + workers behind Redis instead of one process"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="the trace's phases x this (0.5: half as long)"
    )
    parser.add_argument("--peak", type=float, default=3.5, help="the surge's rate as a multiple of capacity")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--capacity-seconds", type=float, default=45.0)
    parser.add_argument("--runs", default="a,b,c1,c2,d,e")
    parser.add_argument(
        "--ttft", default="", help="per-tier TTFT targets in s (default: from the unloaded TTFT)"
    )
    parser.add_argument(
        "--tpot", default="", help="per-tier TPOT targets in s (default: from the loaded TPOT)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--measured",
        help="a previous run's surge.json: reuse its capacity and latencies (the same trace and SLOs, to compare "
        "two builds of the server) instead of measuring them",
    )
    return parser.parse_args()


def _configs(measured: dict[str, float], variant: str | None, capacity: float) -> dict[str, list[str]]:
    latency = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--prefill-chunk", "128"]
    throughput = ["--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]
    wait_latency = round(1.5 * measured["loaded_e2e_s"], 3)
    wait_processing = round(measured["unloaded_e2e_s"] / 2, 3)
    return {
        "a": latency,
        "b": throughput,
        "c1": [*throughput, "--admission-wait", str(wait_latency)],
        "c2": [*throughput, "--admission-wait", str(wait_processing)],
        "d": [*throughput, "--control", "--control-capacity", f"{capacity:.3f}"],
        "e": [
            *throughput,
            "--control",
            "--control-capacity",
            f"{capacity:.3f}",
            *([variant] if variant else []),
        ],
        "e2": [  # (e) on a fleet whose worker processes each hold both builds
            *throughput,
            "--control",
            "--control-capacity",
            f"{capacity:.3f}",
            *([variant] if variant else []),
            "--worker-variants",
            "all",
        ],
    }


def main() -> None:
    args = _arguments()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from qpack.bench.serving import sharegpt_requests
    from quantize.model.sources import load_tokenizer

    tokenizer = load_tokenizer(Path(args.artifact))
    picked = sharegpt_requests(tokenizer, 400, max_prompt=384, max_output=args.max_tokens, seed=args.seed)
    requests = [
        {
            "messages": r.prompt,
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in picked
    ]
    common = ["--kv-memory", "256MB", "--request-timeout", "60", "--max-queue", "256"]
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())["measured"]
    else:
        print("measuring capacity ...", flush=True)
        measured = capacity(
            args.artifact, [*common, "--max-num-seqs", "32"], requests, args.capacity_seconds, out
        )
    print(json.dumps(measured, indent=1), flush=True)
    ttft = (
        [float(x) for x in args.ttft.split(",")]
        if args.ttft
        else [round(max(1.5, 6 * measured["unloaded_ttft_s"]) * k, 2) for k in (1, 2.5, 6)]
    )
    tpot = (
        [float(x) for x in args.tpot.split(",")]
        if args.tpot
        else [round(2 * measured["loaded_tpot_s"] * k, 3) for k in (1, 1.5, 2.5)]
    )
    slo = dict(zip(TIERS, zip(ttft, tpot, strict=True), strict=True))
    kl = _variant_kl([args.artifact, *([args.variant] if args.variant else [])])
    budget = 1.5 * max(kl.values()) if len(kl) > 1 else None
    tenants = tenants_file(out / "tenants.toml", ttft, tpot, budget)
    arrivals = trace(measured["capacity_rps"], args.peak, args.scale, args.seed, len(requests))
    phases = (60 * args.scale, 70 * args.scale, 190 * args.scale)
    configs = _configs(measured, args.variant, measured["capacity_rps"])
    report: dict[str, Any] = {
        "command": sys.argv,
        "measured": measured,
        "slo": slo,
        "kl": kl,
        "arrivals": len(arrivals),
        "runs": {},
    }
    with LocalRedis(out / "redis") if args.fleet else _Nothing() as redis:
        for name in args.runs.split(","):
            extra = configs[name]
            fleet = (
                ["--role", "all", "--workers", str(args.workers), "--redis", redis.url] if args.fleet else []
            )
            run_args = [args.artifact, *common, "--tenants", str(tenants), *fleet, *extra]
            print(f"run {name}: {' '.join(run_args)}", flush=True)
            engines = args.workers * (2 if name == "e2" and args.variant else 1)  # e2: both builds each
            result = run_one(name, run_args, arrivals, requests, out, engines if args.fleet else 0)
            (out / f"run-{name}.json").write_text(json.dumps(result))
            summary = summarize(result["outcomes"], slo, (phases[0], phases[2]), kl)
            summary["controller"] = controller_timing(
                result["samples"],
                phases[0],
                (10 * args.scale, phases[0]),
                (phases[1] + 20 * args.scale, phases[2]),
            )
            report["runs"][name] = summary
            timeline(name, result, out, phases)
            print(json.dumps(summary, indent=1, default=str), flush=True)
    (out / "surge.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "surge.md").write_text(markdown(report))
    print(markdown(report))


class _Nothing:
    url = ""

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _variant_kl(paths: list[str]) -> dict[str, float]:
    found = {}
    for path in paths:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        found[manifest["name"]] = float((manifest.get("quality") or {}).get("kl") or 0.0)
    return found


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| run | tier | attainment | met/asked | goodput r/s | shed | refused | lost | TTFT p50/p95/p99 s | TPOT p50/p95 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in report["runs"].items():
        for tier, t in run["tiers"].items():
            ttft = "/".join(f"{t['ttft_s'][q]:.2f}" for q in (50, 95, 99))
            tpot = "/".join(f"{t['tpot_s'][q]:.3f}" for q in (50, 95))
            lines.append(
                f"| {name} | {tier} | {t['attainment']:.1%} | {t['met_of_asked']:.1%} | {t['goodput_rps']:.2f} | "
                f"{t['shed']} | {t['refused']} | {t['lost']} | {ttft} | {tpot} |"
            )
    lines += [
        "",
        "| run | goodput r/s | tokens/s | surge tokens/s | variant share | quality cost (share x KL) | controller |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in report["runs"].items():
        share = ", ".join(f"{v} {s:.0%}" for v, s in run["variant_share"].items())
        lines.append(
            f"| {name} | {run['goodput_rps']:.2f} | {run['tokens_per_s']:.1f} | {run['surge_tokens_per_s']:.1f} | "
            f"{share} | {run['quality_cost_kl']:.5f} | {run.get('controller') or '-'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
