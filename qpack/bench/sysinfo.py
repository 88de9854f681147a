"""What a benchmark ran on (so a result can be reproduced) and how fast this machine can read memory.

Decode at small batch is memory-bound: every generated token reads every weight once. So the honest yardstick
is bytes read per token divided by the machine's measured read bandwidth, the tokens/s ceiling no kernel can
beat. The probe streams a buffer much larger than the last-level cache and keeps the best of several passes.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch


def memory_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained read bandwidth in GB/s (sum over a float32 buffer, all torch threads, best of `repeats`)."""
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9


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
