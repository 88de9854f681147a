"""Run one benchmark and write its results folder (the exact command, machine info, JSON, a Markdown table, PNGs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qpack.bench.config import DecodeConfig, ServeBenchConfig
from qpack.bench.decode import run_decode_bench
from qpack.bench.report import (
    decode_markdown,
    decode_plots,
    results_dir,
    serve_markdown,
    serve_plots,
    write_results,
)
from qpack.bench.serving import run_serve_bench


def bench_decode(config: DecodeConfig, out_dir: Path | None = None) -> tuple[dict[str, Any], Path]:
    """Decode and prefill speed of an artifact against FP32 `generate`; (result, results folder)."""
    from quantize.io.artifact import read_manifest

    read_manifest(config.artifact)  # a clear error before any worker starts
    result = run_decode_bench(config)
    folder = results_dir(out_dir, "decode")
    write_results(folder, result, decode_markdown(result), decode_plots(result, folder))
    return result, folder


def bench_serve(
    config: ServeBenchConfig, out_dir: Path | None = None, log: Callable[[str], None] = print
) -> tuple[dict[str, Any], Path]:
    """A ShareGPT replay against qpack serve and the naive baseline; (result, results folder)."""
    result = run_serve_bench(config, log)
    folder = results_dir(out_dir, "serve")
    write_results(folder, result, serve_markdown(result), serve_plots(result, folder))
    return result, folder
