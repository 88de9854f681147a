"""Process memory: give large freed buffers back to the OS, and how much memory is available now.

glibc's allocator serves large requests from its heap once its dynamic mmap threshold has grown, and a heap
fragmented by 25-100 MB temporaries (logit chunks, dequantized weights, activations) is not returned to the OS.
On SmolLM2 that kept ~450 MB of freed memory resident during `qpack quantize`. Pinning the mmap and trim
thresholds to 1 MiB makes every large buffer its own mapping, released on free, at the cost of page faults on
reuse. That trade is right for batch jobs (calibrate, quantize, evaluate, build), where each big buffer is used
a few times, and wrong for a server, which allocates the same activations every step: under the policy an int8
prefill of 128 tokens took ~1.0 s instead of ~0.6 s. The CLI applies it to every command except `serve`.
`trim_heap` hands free pages back on demand (before an RSS reading, after a server's engine is built), and
`available_memory` is what the memory-bound passes (`--max-memory`, the KV pool's fraction) size themselves by,
and `peak_rss_mb` the peak a manifest or benchmark reports."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1


_M_MMAP_THRESHOLD = -3


_applied = False


def _libc() -> ctypes.CDLL | None:
    """glibc on Linux, else None (the policy and the trim are glibc calls)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_freed_memory(threshold_bytes: int = 1 << 20) -> bool:
    """Apply the policy (glibc only); returns whether it took effect."""
    global _applied
    if _applied:
        return True
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1
        )
    except AttributeError:
        return False
    _applied = ok
    return ok


def trim_heap() -> bool:
    """Hand free heap pages back to the OS now (glibc `malloc_trim`), so the next RSS reading is honest."""
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except AttributeError:
        return False


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (psutil's `available`; /proc/meminfo without it)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 8 * 2**30


def peak_rss_mb() -> float:
    """This process's own peak resident memory in MB: /proc's VmHWM, which starts afresh at exec, where
    `ru_maxrss` carries over the peak of the process that spawned it (a benchmark's child would report its
    parent's); `ru_maxrss` where /proc has no VmHWM."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
