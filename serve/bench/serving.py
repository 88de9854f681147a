"""`qpack bench serve`: replay real ShareGPT traffic against `qpack serve` and the naive baseline, same run.

The request mix follows vLLM's serving benchmark: prompts are the first human turns of real ShareGPT
conversations (sent through the chat endpoint, so the model's chat template applies) and each request asks for
as many tokens as the real assistant reply had (capped), with `ignore_eos` so both servers generate exactly
that. For every concurrency level (or Poisson rate) the same requests go to the artifact server and to the
naive one-request-at-a-time Hugging Face `generate` server on the FP32 model. While a level runs, the server
processes' RSS is sampled and qpack's /metrics scraped for KV utilisation. Loopback only; bounded in requests
and time.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve.bench.loadgen import BenchRequest, run_level


@dataclass(frozen=True)
class ServeBenchConfig:
    artifact: Path | None
    url: str | None = None
    baseline: str = "naive"
    baseline_model: str | None = None
    levels: tuple[int, ...] = (10, 30, 50)
    rates: tuple[float, ...] = ()
    requests_per_level: int | None = None
    max_prompt_tokens: int = 512
    max_output_tokens: int = 128
    max_seconds: float = 900.0
    abort_fraction: float = 0.0
    seed: int = 0
    kv_memory: str = "512MB"
    max_num_seqs: int = 64
    extra_server_args: tuple[str, ...] = ()


def sharegpt_requests(
    tokenizer: Any, count: int, max_prompt: int, max_output: int, seed: int
) -> list[BenchRequest]:
    """Real user prompts and real reply lengths from the bundled ShareGPT export."""
    from calibrate.sources import default_queries_path, read_source

    conversations = read_source(default_queries_path()).conversations
    rng = random.Random(seed)
    order = list(range(len(conversations)))
    rng.shuffle(order)
    requests: list[BenchRequest] = []
    for index in order:
        conversation = conversations[index]
        if len(conversation) < 2 or conversation[0].role != "user" or conversation[1].role != "assistant":
            continue
        prompt, reply = conversation[0].content.strip(), conversation[1].content.strip()
        if not prompt or not reply:
            continue
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        output_tokens = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        if prompt_tokens > max_prompt or output_tokens < 4:
            continue
        requests.append(BenchRequest(messages, min(output_tokens, max_output), prompt_tokens))
        if len(requests) >= count:
            break
    return requests


class ServerProcess:
    """A server subprocess on loopback, watched for RSS."""

    def __init__(self, command: list[str], port: int, name: str) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        self.peak_rss = 0
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, daemon=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} server exited: {self.process.stderr.read() if self.process.stderr else ''}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self._watch.start()
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} server did not become healthy in {timeout} s")

    def _sample(self) -> None:
        import psutil

        process = psutil.Process(self.process.pid)
        while not self._stop.wait(0.1):
            try:
                self.peak_rss = max(self.peak_rss, process.memory_info().rss)
            except psutil.Error:
                return

    def reset_peak(self) -> None:
        self.peak_rss = 0

    def stop(self) -> None:
        self._stop.set()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


class MetricsWatcher:
    """Scrapes qpack /metrics during a level: peak KV utilisation and peak KV waste."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak_usage = 0.0
        self.peak_waste = 0.0  # waste ratio when the most blocks were in use (the "at peak")
        self.max_waste = 0.0  # worst instantaneous ratio (a lone short sequence can show 50%)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def parse(text: str) -> dict[str, float]:
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.2):
                try:
                    values = self.parse(client.get(self.url + "/metrics").text)
                except httpx.HTTPError:
                    continue
                total = values.get("qpack_kv_blocks_total", 0.0)
                waste = values.get("qpack_kv_waste_ratio", 0.0)
                if total:
                    usage = values.get("qpack_kv_blocks_used", 0.0) / total
                    if usage >= self.peak_usage:
                        self.peak_usage, self.peak_waste = usage, waste
                self.max_waste = max(self.max_waste, waste)

    def __enter__(self) -> MetricsWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_serve_bench(config: ServeBenchConfig, log: Any = print) -> dict[str, Any]:
    from quantize.artifact import read_manifest
    from quantize.models import load_tokenizer
    from serve.bench.sysinfo import machine_info
    from serve.server import free_port

    if config.artifact is None and config.url is None:
        raise ValueError("give an artifact to serve or --url of a running server")
    reference_model = config.baseline_model
    if config.artifact is not None:
        tokenizer = load_tokenizer(config.artifact)
        reference_model = reference_model or read_manifest(config.artifact)["source"]["model_id"]
    else:
        from quantize.models import resolve_model

        tokenizer = load_tokenizer(resolve_model(reference_model or "smollm2-135m"))
    levels: list[tuple[str, dict[str, Any]]] = [(f"c{c}", {"concurrency": c}) for c in config.levels]
    levels += [(f"r{r}", {"rate": r}) for r in config.rates]
    count = max(
        [config.requests_per_level or c for c in config.levels]
        + [config.requests_per_level or 50 for _ in config.rates]
        + [1]
    )
    requests = sharegpt_requests(
        tokenizer, count, config.max_prompt_tokens, config.max_output_tokens, config.seed
    )
    log(
        f"request mix: {len(requests)} ShareGPT prompts, prompt tokens avg {sum(r.prompt_tokens for r in requests) / len(requests):.0f}, "
        f"output tokens avg {sum(r.max_tokens for r in requests) / len(requests):.0f}"
    )
    servers: dict[str, ServerProcess | None] = {}
    if config.url is None:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "evals.cli",
            "serve",
            str(config.artifact),
            "--port",
            str(port),
            "--kv-memory",
            config.kv_memory,
            "--max-num-seqs",
            str(config.max_num_seqs),
            "--max-queue",
            "100000",
            *config.extra_server_args,
        ]
        servers["artifact"] = ServerProcess(command, port, "qpack")
    if config.baseline == "naive":
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "serve.bench.naive",
            "--model",
            str(reference_model),
            "--port",
            str(port),
        ]
        servers["baseline"] = ServerProcess(command, port, "naive")
    results: dict[str, Any] = {"kind": "serve", "levels": []}
    try:
        for server in servers.values():
            if server is not None:
                server.wait_ready()
        targets = {"artifact": config.url or servers["artifact"].url}  # type: ignore[union-attr]
        if "baseline" in servers:
            targets["baseline"] = servers["baseline"].url  # type: ignore[union-attr]
        for label, spec in levels:
            n = config.requests_per_level or spec.get("concurrency") or 50
            level_requests = requests[:n]
            entry: dict[str, Any] = {"level": label, **spec, "requests": len(level_requests)}
            for side, url in targets.items():
                server = servers.get(side)
                if server is not None:
                    server.reset_peak()
                watcher = MetricsWatcher(url) if side == "artifact" else None
                if watcher:
                    watcher.__enter__()
                try:
                    level = asyncio.run(
                        run_level(
                            url,
                            level_requests,
                            max_seconds=config.max_seconds,
                            abort_fraction=config.abort_fraction if side == "artifact" else 0.0,
                            seed=config.seed,
                            **spec,
                        )
                    )
                finally:
                    if watcher:
                        watcher.__exit__()
                summary = level.summary()
                summary["peak_rss_mb"] = server.peak_rss / 2**20 if server is not None else None
                if watcher:
                    summary["peak_kv_usage"] = watcher.peak_usage
                    summary["peak_kv_waste"] = watcher.peak_waste
                    summary["max_kv_waste"] = watcher.max_waste
                entry[side] = summary
                log(
                    f"{label} {side}: {summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} tok/s, "
                    f"p99 {summary['e2e_s']['p99']:.2f}s, errors {summary['errors']}"
                )
            if "baseline" in entry and entry["baseline"]["requests_per_s"]:
                entry["requests_per_s_ratio"] = (
                    entry["artifact"]["requests_per_s"] / entry["baseline"]["requests_per_s"]
                )
                entry["tokens_per_s_ratio"] = (
                    entry["artifact"]["output_tokens_per_s"] / entry["baseline"]["output_tokens_per_s"]
                )
            results["levels"].append(entry)
        if "artifact" in servers or config.url:
            metrics = MetricsWatcher.parse(httpx.get(targets["artifact"] + "/metrics", timeout=10).text)
            results["final_kv_blocks_used"] = metrics.get("qpack_kv_blocks_used")
            results["server_errors"] = sum(
                v for k, v in metrics.items() if k.startswith("qpack_requests_total") and "error" in k
            )
    finally:
        for server in servers.values():
            if server is not None:
                server.stop()
    results["settings"] = {
        k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
        for k, v in config.__dict__.items()
    }
    results["machine"] = machine_info()
    return results
