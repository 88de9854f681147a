"""Benchmarks users choose configurations from: decode speed, serving load, memory; baselines in the same run.

`bench_decode` and `bench_serve` (`run`) run one benchmark and write its results folder (the exact command, machine
info, JSON, a Markdown table, PNGs); the modules beside them hold the machinery: worker processes for decode
(`decode`), the ShareGPT replay and server processes (`serving`), the load generator (`loadgen`), the naive
one-request-at-a-time baseline server (`naive`), reports (`report`) and machine facts (`sysinfo`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from qpack.bench.config import DecodeConfig, ServeBenchConfig
    from qpack.bench.run import bench_decode, bench_serve

__all__ = ["DecodeConfig", "ServeBenchConfig", "bench_decode", "bench_serve"]

__getattr__ = lazy_exports(
    "qpack.bench",
    {
        "DecodeConfig": "qpack.bench.config",
        "ServeBenchConfig": "qpack.bench.config",
        "bench_decode": "qpack.bench.run",
        "bench_serve": "qpack.bench.run",
    },
)
