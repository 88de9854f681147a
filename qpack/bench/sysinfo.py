"""What a benchmark ran on (so a result can be reproduced) and how fast this machine can read memory.

Decode at small batch is memory-bound: every generated token reads every weight once. So the honest yardstick
is bytes read per token divided by the machine's measured read bandwidth, the tokens/s ceiling no kernel can
beat. The probe streams a buffer many times the last-level cache (a STREAM-like read on torch's threads) and
reports the median of several passes with their spread: the best pass of a few (the probe before) read 35 and 54
GB/s in two runs on one machine, so a fraction of it was not a number to steer by.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Bandwidth:
    """Read bandwidth over `passes` reads of a `buffer_mb` buffer: the median (what ceilings are computed from)
    and the fastest and slowest pass (their spread says how much to trust it)."""

    median_gbs: float
    best_gbs: float
    worst_gbs: float
    buffer_mb: int
    passes: int

    def to_json(self) -> dict[str, float | int]:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of cpu0 (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def measure_bandwidth(megabytes: int | None = None, passes: int = 9) -> Bandwidth:
    """Sustained read bandwidth: a float32 buffer of `megabytes` (default: 16x the last-level cache, at least 512
    MB and at most 2 GB) summed on all torch threads `passes` times after one untimed pass (which also faults the
    pages in)."""
    if megabytes is None:
        cache = last_level_cache_bytes() or 32 * 2**20
        megabytes = min(2048, max(512, 16 * cache // 2**20))
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    buffer.sum()
    rates = []
    for _ in range(passes):
        started = time.perf_counter()
        buffer.sum()
        rates.append(buffer.numel() * 4 / (time.perf_counter() - started) / 1e9)
    return Bandwidth(statistics.median(rates), max(rates), min(rates), megabytes, passes)


def memory_bandwidth_gbs(megabytes: int | None = None, passes: int = 9) -> float:
    """The median of `measure_bandwidth` in GB/s."""
    return measure_bandwidth(megabytes, passes).median_gbs


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    import psutil

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "versions": {
            name: _version(name)
            for name in ("qpack", "torch", "transformers", "safetensors", "fastapi", "uvicorn")
        },
    }
