"""Benchmark machinery: the load generator against a stub server, percentiles, the bandwidth probe, schemas."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from qpack.bench.loadgen import BenchRequest, percentile, run_level
from qpack.bench.sysinfo import (
    last_level_cache_bytes,
    machine_info,
    measure_bandwidth,
    memory_bandwidth_gbs,
)
from serve.http import free_port


def stub_app() -> FastAPI:
    """Streams `max_tokens` chunks, 10 ms apart after a 50 ms first token; prompt 'fail' gives a 500."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def events():
            await asyncio.sleep(0.05)
            for _ in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'text': 'x', 'finish_reason': None}]})}\n\n"
                await asyncio.sleep(0.01)
            usage = {
                "completion_tokens": body["max_tokens"],
                "prompt_tokens": 1,
                "total_tokens": 1 + body["max_tokens"],
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():  # what llama-server answers without --metrics
        error = {
            "code": 501,
            "message": "This server does not support metrics endpoint.",
            "type": "not_supported",
        }
        return JSONResponse({"error": error}, status_code=501)

    return app


@pytest.fixture(scope="module")
def stub_url():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stub_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join()


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    values = rng.random(101).tolist()
    for q in (0, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert np.isnan(percentile([], 50))


def test_loadgen_counts_timings_and_errors(stub_url: str) -> None:
    requests = [BenchRequest("hi", 5)] * 6 + [BenchRequest("fail", 5)] * 2
    level = asyncio.run(run_level(stub_url, requests, concurrency=4, max_seconds=30))
    summary = level.summary()
    assert summary["completed"] == 6 and summary["errors"] == 2 and summary["unfinished"] == 0
    assert "HTTP 500" in summary["error_samples"][0]
    assert 0.04 < summary["ttft_s"]["p50"] < 0.5
    assert 0.008 < summary["tpot_s"]["p50"] < 0.1
    assert summary["e2e_s"]["p99"] >= summary["e2e_s"]["p50"] >= 0.09
    assert summary["output_tokens_per_s"] > 0


def test_loadgen_is_bounded_in_time_and_aborts_are_not_errors(stub_url: str) -> None:
    slow = [BenchRequest("hi", 200)] * 4
    started = time.perf_counter()
    level = asyncio.run(run_level(stub_url, slow, concurrency=2, max_seconds=1.0))
    assert time.perf_counter() - started < 5
    summary = level.summary()
    assert summary["unfinished"] >= 2 and summary["errors"] == 0
    aborted = asyncio.run(
        run_level(stub_url, [BenchRequest("hi", 20)] * 6, concurrency=3, abort_fraction=1.0, max_seconds=30)
    )
    assert aborted.summary()["aborted"] == 6 and aborted.summary()["errors"] == 0


def test_poisson_mode(stub_url: str) -> None:
    level = asyncio.run(run_level(stub_url, [BenchRequest("hi", 2)] * 5, rate=50.0, max_seconds=30, seed=1))
    assert level.summary()["completed"] == 5 and level.label == "rate 50.0/s"


def test_bandwidth_probe_and_machine_info() -> None:
    bandwidth = memory_bandwidth_gbs(megabytes=64, passes=3)
    assert 0.5 < bandwidth < 2000
    probe = measure_bandwidth(megabytes=64, passes=5)
    assert probe.worst_gbs <= probe.median_gbs <= probe.best_gbs and probe.passes == 5
    assert probe.buffer_mb == 64 and json.dumps(probe.to_json())
    cache = last_level_cache_bytes()
    assert cache is None or cache >= 2**16
    info = machine_info()
    assert info["cpu_count"] >= 1 and info["torch_threads"] >= 1 and info["versions"]["torch"]
    json.dumps(info)


def _artifact(path: Path, calibration: Path, preset: str, group_size: int | None = None) -> Path:
    from quantize.config import QuantizeConfig
    from quantize.formats.schemes import Int4
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS
    from quantize.sensitivity.settings import SensitivityConfig

    config = QuantizeConfig(
        output=path,
        calibration=calibration,
        preset=PRESETS[preset],
        schemes=(Int4(group_size),) if group_size else (),
        sensitivity=SensitivityConfig(num_tokens=32),
        calib_tokens=128,
        eval_tokens=64,
    )
    quantize_model(config)
    return path


def test_decode_results_schema(tmp_path, tiny_llama, tiny_llama_calibration) -> None:
    from qpack.bench.decode import DecodeConfig, run_decode_bench
    from qpack.bench.report import decode_markdown, decode_plots, results_dir, write_results

    art = _artifact(tmp_path / "art", tiny_llama_calibration, "int8")
    config = DecodeConfig(
        art, batches=(1, 2), prompt_tokens=8, new_tokens=4, repeats=1, prefill_dtype="bfloat16"
    )
    result = run_decode_bench(config)
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert result["artifact"]["numerics"]["prefill_dtype"] == "bfloat16"
    for row in result["rows"]:
        for side in ("artifact", "reference"):
            assert (
                row[side]["decode_tokens_per_s"] > 0
                and row[side]["prefill_tokens_per_s"] > 0
                and row[side]["peak_rss_mb"] > 50
            )
    assert result["bound"]["ceiling_tokens_per_s"] > 0 and result["profile_batch1"]["step_ms"] > 0
    folder = results_dir(tmp_path / "out", "decode")
    write_results(folder, result, decode_markdown(result), decode_plots(result, folder))
    assert {"command.txt", "results.json", "report.md", "decode_throughput.png", "memory_vs_batch.png"} <= {
        p.name for p in folder.iterdir()
    }
    assert json.loads((folder / "results.json").read_text())["kind"] == "decode"


def test_decode_bench_of_an_int4_artifact_on_torchs_kernels(
    tmp_path, monkeypatch, tiny_llama_calibration
) -> None:
    """Without the native kernels int4 layers run torch's int4pack kernel: the bytes per token are that packed
    copy's, asked of the module (the benchmark once read attributes Int4Linear no longer had)."""
    from qpack.bench import DecodeConfig, bench_decode

    art = _artifact(tmp_path / "int4", tiny_llama_calibration, "int4", group_size=32)
    monkeypatch.setenv("QPACK_NATIVE", "0")
    result, folder = bench_decode(
        DecodeConfig(art, batches=(1,), prompt_tokens=8, new_tokens=4, repeats=1), tmp_path / "out"
    )
    assert result["rows"][0]["artifact"]["decode_tokens_per_s"] > 0
    assert result["bound"]["artifact_bytes_per_token"] > 0 and (folder / "results.json").is_file()
    breakdown = result["profile_batch1"]["breakdown_ms"]
    assert breakdown["fused decoder layers (native: linears, attention, norms)"] == 0
    assert breakdown["quantized kernels"] > 0  # torch's _weight_int4pack_mm_for_cpu


def test_decode_bench_with_speculation_runs_the_artifact_with_and_without(
    tmp_path, tiny_llama_calibration
) -> None:
    """`--speculative`: the artifact side runs with speculation and without, alternating, on real text prompts;
    the rows carry the ratio and the acceptance."""
    from qpack.bench import DecodeConfig, bench_decode

    art = _artifact(tmp_path / "int8", tiny_llama_calibration, "int8")
    config = DecodeConfig(art, batches=(1,), prompt_tokens=16, new_tokens=12, repeats=1, speculative="ngram")
    result, _folder = bench_decode(config, tmp_path / "out")
    row = result["rows"][0]
    assert row["artifact_plain"]["decode_tokens_per_s"] > 0 and row["speculative_ratio"] > 0
    assert 0.0 <= row["acceptance"] <= 1.0
    assert result["settings"]["prompts"] == "ShareGPT text"


def test_a_server_without_qpack_metrics_is_reported_as_unavailable(stub_url: str) -> None:
    """`bench serve --url` against another OpenAI-compatible server: a JSON error body or another exporter's
    metrics are 'unavailable', never a crash at the end of the run."""
    from qpack.bench.serving import MetricsWatcher, _final_metrics

    foreign = '# HELP llamacpp:tokens_predicted_total x\nllamacpp:tokens_predicted_total 12\nweird line here\n{"a": 1}'
    assert MetricsWatcher.parse(foreign) == {"llamacpp:tokens_predicted_total": 12.0}
    assert _final_metrics(stub_url) == {"final_kv_blocks_used": None, "server_errors": None}
    with MetricsWatcher(stub_url) as watcher:
        time.sleep(0.5)
    assert not watcher.seen
