"""Compiling the native kernels once per machine: instruction set, compiler flags, a cached build folder.

The C++ sources under `csrc/` are shipped with the package and compiled with torch's `cpp_extension.load` on
first use (~1 min), into a folder under qpack's user cache dir keyed by everything the binary depends on: the
sources' contents, the compiler flags, torch's version and location, and the Python environment. torch's build
files name the environment's include paths, so two venvs sharing a folder would rebuild on every switch; an
AVX-512 build must never load on an AVX2 machine sharing the cache. A lock left by a process killed mid-build
would make every later start wait forever: it is cleared when stale.

On CPUs with AVX-512 (F/BW/VL) and VNNI the kernels are built for them (int8/int4 rows multiply-accumulate int16
pairs with `vpdpwssd`, float rows run 16 wide); elsewhere for AVX2+FMA. Both use F16C (every AVX2 CPU has it) to
read int4's float16 group scales. `QPACK_NATIVE_ISA=avx2` forces the AVX2
build on any machine (to compare, or to test both).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from quantize.common.cache import cache_dir

_log = logging.getLogger("qpack.kernels")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# Translation units, in link order; the headers they include are hashed too (any file in csrc/).
SOURCES = ("linear.cpp", "gemm_amx.cpp", "attention.cpp", "decode_layers.cpp", "peak.cpp", "bindings.cpp")
AVX512_FEATURES = ("avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni")
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}
# The largest int4 group the kernels take: each group's exact sum of int16 activations times 4-bit weights
# (|sum| <= 32767 * 15 * group) must fit the int32 lanes. Passed to the sources as QPACK_INT4_MAX_GROUP.
INT4_MAX_GROUP = 4096
STALE_LOCK_S = 600.0  # a build takes ~1 min; a lock this old was left by a process killed mid-build


def cpu_supported() -> bool:
    """Whether this CPU runs at least the AVX2 build."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def avx512_supported() -> bool:
    """Whether this CPU has the AVX-512 F/BW/VL and VNNI instructions the AVX-512 build uses."""
    capabilities = torch.cpu.get_capabilities()
    return all(capabilities.get(feature) for feature in AVX512_FEATURES)


def target_isa() -> str:
    """'avx512' where the CPU has AVX-512 F/BW/VL and VNNI, else 'avx2' (or as QPACK_NATIVE_ISA=avx2 says)."""
    if os.environ.get("QPACK_NATIVE_ISA", "").lower() == "avx2":
        return "avx2"
    return "avx512" if avx512_supported() else "avx2"


def compile_flags(isa: str) -> list[str]:
    return ["-O3", *ISA_FLAGS[isa], "-fopenmp", f"-DQPACK_INT4_MAX_GROUP={INT4_MAX_GROUP}"]


def source_paths() -> list[Path]:
    return [SOURCE_DIR / name for name in SOURCES]


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_folder(flags: list[str]) -> tuple[str, Path]:
    """(extension name, folder) for these flags in this environment; a stale lock in it is removed."""
    key = "\n".join((_sources_digest(), " ".join(flags), torch.__version__, sys.prefix, torch.__file__))
    name = f"qpack_native_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder = cache_dir() / "native" / name
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        age = 0.0
    if age > STALE_LOCK_S:
        _log.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)
    return name, folder


def _ninja_on_path() -> None:
    """torch builds with `ninja` from PATH; a venv's own ninja (the `ninja` wheel) is not on PATH when the venv's
    python is run without activating it."""
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(scripts, "ninja")):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def load(isa: str) -> ModuleType:
    """Compile (first time for this key) and import the extension built for `isa`; raises on any failure (no
    compiler, no ninja, a build error)."""
    from torch.utils.cpp_extension import load as load_extension

    _ninja_on_path()
    flags = compile_flags(isa)
    name, folder = build_folder(flags)
    return load_extension(
        name=name,
        sources=[str(path) for path in source_paths()],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(SOURCE_DIR)],
        build_directory=str(folder),
        verbose=False,
    )
