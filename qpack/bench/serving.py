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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from qpack.bench.config import ServeBenchConfig
from qpack.bench.loadgen import BenchRequest, run_level


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
        self.seen = False  # whether the server exported qpack's KV metrics at all
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def parse(text: str) -> dict[str, float]:
        """Prometheus text as {series: value}; lines that are not `name value` (another exporter's format, a JSON
        error body) are skipped: a server without qpack's metrics reports them as unavailable, never fails."""
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.strip().rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.2):
                try:
                    values = self.parse(client.get(self.url + "/metrics").text)
                except (httpx.HTTPError, UnicodeDecodeError):
                    continue
                total = values.get("qpack_kv_blocks_total", 0.0)
                waste = values.get("qpack_kv_waste_ratio", 0.0)
                if total:
                    self.seen = True
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


def run_serve_bench(config: ServeBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every level against the qpack server (started here, or --url) and the baseline, each level's requests
    sent to both in turn; servers started here are stopped whatever happens."""
    from qpack.bench.sysinfo import machine_info

    config.validate()
    tokenizer, reference_model = _tokenizer_and_reference(config)
    levels: list[tuple[str, dict[str, Any]]] = [(f"c{c}", {"concurrency": c}) for c in config.levels]
    levels += [(f"r{r}", {"rate": r}) for r in config.rates]
    count = max([config.requests_per_level or spec.get("concurrency") or 50 for _, spec in levels] + [1])
    requests = sharegpt_requests(
        tokenizer, count, config.max_prompt_tokens, config.max_output_tokens, config.seed
    )
    log(
        f"request mix: {len(requests)} ShareGPT prompts, prompt tokens avg "
        f"{sum(r.prompt_tokens for r in requests) / len(requests):.0f}, "
        f"output tokens avg {sum(r.max_tokens for r in requests) / len(requests):.0f}"
    )
    servers = _start_servers(config, reference_model)
    results: dict[str, Any] = {"kind": "serve", "levels": []}
    try:
        for server in servers.values():
            server.wait_ready()
        targets = {"artifact": config.url or servers["artifact"].url}
        results["numerics"] = _numerics(targets["artifact"])
        if "baseline" in servers:
            targets["baseline"] = servers["baseline"].url
        for label, spec in levels:
            level_requests = requests[: config.requests_per_level or spec.get("concurrency") or 50]
            results["levels"].append(_run_level(config, label, spec, level_requests, targets, servers, log))
        results.update(_final_metrics(targets["artifact"]))
    finally:
        for server in servers.values():
            server.stop()
    results["settings"] = {
        k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
        for k, v in config.__dict__.items()
    }
    results["machine"] = machine_info()
    return results


def _tokenizer_and_reference(config: ServeBenchConfig) -> tuple[Any, str]:
    """The tokenizer to measure prompts with, and the model the naive baseline serves (the artifact's source)."""
    from quantize.io.artifact import read_manifest
    from quantize.model.sources import load_tokenizer, resolve_model

    if config.artifact is not None:
        reference = config.baseline_model or read_manifest(config.artifact)["source"]["model_id"]
        return load_tokenizer(config.artifact), reference
    reference = config.baseline_model or "smollm2-135m"
    return load_tokenizer(resolve_model(reference)), reference


def _start_servers(config: ServeBenchConfig, reference_model: str) -> dict[str, ServerProcess]:
    from serve.http import free_port

    servers: dict[str, ServerProcess] = {}
    if config.url is None:
        port = free_port()
        command = [sys.executable, "-m", "qpack", "serve", str(config.artifact), "--port", str(port)]
        command += ["--kv-memory", config.kv_memory, "--max-num-seqs", str(config.max_num_seqs)]
        command += ["--max-queue", "100000", "--prefill-dtype", config.prefill_dtype]
        command += list(config.extra_server_args)
        servers["artifact"] = ServerProcess(command, port, "qpack")
    if config.baseline == "naive":
        port = free_port()
        command = [sys.executable, "-m", "qpack.bench.naive", "--model", reference_model, "--port", str(port)]
        servers["baseline"] = ServerProcess(command, port, "naive")
    return servers


def _run_level(
    config: ServeBenchConfig,
    label: str,
    spec: dict[str, Any],
    requests: list[BenchRequest],
    targets: dict[str, str],
    servers: dict[str, ServerProcess],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One level's requests against each side in turn, with each side's peak RSS and (qpack) KV use."""
    entry: dict[str, Any] = {"level": label, **spec, "requests": len(requests)}
    for side, url in targets.items():
        server = servers.get(side)
        if server is not None:
            server.reset_peak()
        abort_fraction = config.abort_fraction if side == "artifact" else 0.0
        with MetricsWatcher(url) as watcher:
            level = asyncio.run(
                run_level(
                    url,
                    requests,
                    max_seconds=config.max_seconds,
                    abort_fraction=abort_fraction,
                    seed=config.seed,
                    **spec,
                )
            )
        summary = level.summary()
        summary["peak_rss_mb"] = server.peak_rss / 2**20 if server is not None else None
        if side == "artifact":
            summary["peak_kv_usage"] = watcher.peak_usage if watcher.seen else None
            summary["peak_kv_waste"] = watcher.peak_waste if watcher.seen else None
            summary["max_kv_waste"] = watcher.max_waste if watcher.seen else None
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
    return entry


def _numerics(url: str) -> dict[str, Any] | None:
    """How the measured server computes, as its `/v1/models` says (None where it does not say: another
    OpenAI-compatible server under --url)."""
    try:
        data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    numerics = data[0].get("numerics") if data and isinstance(data[0], dict) else None
    return numerics if isinstance(numerics, dict) else None


def _final_metrics(url: str) -> dict[str, Any]:
    """KV blocks still in use and server-side errors after the run; None where the server has no qpack metrics
    (another OpenAI-compatible server under --url)."""
    try:
        metrics = MetricsWatcher.parse(httpx.get(url + "/metrics", timeout=10).text)
    except (httpx.HTTPError, UnicodeDecodeError):
        metrics = {}
    errors = [v for k, v in metrics.items() if k.startswith("qpack_requests_total") and "error" in k]
    return {
        "final_kv_blocks_used": metrics.get("qpack_kv_blocks_used"),
        "server_errors": sum(errors) if any(k.startswith("qpack_") for k in metrics) else None,
    }
