"""Read a safetensors file into memory once, each tensor in its own aligned allocation.

`safetensors.torch.load_file` maps the file and hands out views into the mapping. A model that then copies or
reshapes a weight (the int8 kernel's padding and alignment, fusing q/k/v and gate/up into one matrix) leaves the
original pages resident as long as any other tensor still views the file: on SmolLM2 int8 ~130 MB of the 216
MiB file stayed resident twice in a server. The views also sit wherever the file put them, 8-byte aligned,
where torch's AVX-512 int8 kernel needs 16. Reading each tensor with `readinto` into a fresh allocation costs
one copy, leaves nothing file-backed in the process, and every tensor starts on a 64-byte boundary.

The header is validated like safetensors does (size bound, known dtypes, shapes matching byte ranges, ranges
tiling the data section without gaps or overlaps) and every problem is reported in one error.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from quantize.common.errors import QpackError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


Entry = tuple[
    torch.dtype, list[int], int, int
]  # dtype, shape, first and past-the-end byte in the data section


def _entries(
    header: object, data_bytes: int
) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], list[str]]:
    """{name: (dtype, shape, begin, end)} and every problem found, with offsets relative to the data section."""
    if not isinstance(header, dict):
        return {}, ["the header is not a JSON object"]
    entries: dict[str, Entry] = {}
    problems: list[str] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            problems.append(f"{name}: not an object")
            continue
        dtype = DTYPES.get(str(info.get("dtype")))
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if dtype is None:
            problems.append(f"{name}: unknown dtype {info.get('dtype')!r}")
            continue
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            problems.append(f"{name}: bad shape {shape!r}")
            continue
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            problems.append(f"{name}: bad data_offsets {offsets!r}")
            continue
        begin, end = offsets
        expected = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_bytes:
            problems.append(f"{name}: bytes {begin}..{end} outside the {data_bytes}-byte data section")
        elif end - begin != expected:
            problems.append(
                f"{name}: {end - begin} bytes for shape {shape} {info['dtype']} ({expected} expected)"
            )
        else:
            entries[name] = (dtype, shape, begin, end)
    covered = 0
    for name, (_dtype, _shape, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != covered:
            problems.append(f"{name}: starts at byte {begin}, the previous tensor ends at {covered}")
        covered = max(covered, end)
    if not problems and covered != data_bytes:
        problems.append(f"{data_bytes - covered} bytes after the last tensor")
    return entries, problems


def _header(handle: BinaryIO, size: int) -> tuple[dict[str, Entry], int]:
    """The validated entries of an open safetensors file and where its data section starts; ValueError naming
    every problem otherwise."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ValueError("shorter than its 8-byte header length")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"a header of {header_bytes} bytes in a {size}-byte file")
    try:
        header = json.loads(handle.read(header_bytes))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable header: {exc}") from None
    start = 8 + header_bytes
    entries, problems = _entries(header, size - start)
    if problems:
        raise ValueError(
            "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
        )
    return entries, start


@contextmanager
def _reported(path: Path, what: str, fix: str) -> Iterator[None]:
    """OSError and ValueError (a bad header or body) as the one-line QpackError a user can act on."""
    try:
        yield
    except OSError as exc:
        raise QpackError(
            f"{what} {path} is unreadable ({exc.strerror or exc}); check the path and permissions"
        ) from None
    except ValueError as exc:
        raise QpackError(f"{what} {path} is corrupt or truncated ({exc}); {fix}") from None


def check_safetensors(path: str | os.PathLike[str], what: str, fix: str) -> list[str]:
    """Cheap integrity check (header and length, no data read): the tensor names, or QpackError '{what} {path}
    is corrupt or truncated (...); {fix}'."""
    path = Path(path)
    with _reported(path, what, fix), open(path, "rb") as handle:
        entries, _start = _header(handle, path.stat().st_size)
    return sorted(entries)


def read_safetensors(path: str | os.PathLike[str], what: str, fix: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, read (not mapped) into 64-byte-aligned CPU tensors."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    with _reported(path, what, fix), open(path, "rb") as handle:
        entries, start = _header(handle, path.stat().st_size)
        for name, entry in sorted(entries.items(), key=lambda item: item[1][2]):
            tensors[name] = read_entry(handle, start, name, entry)
    return tensors


def index_safetensors(path: str | os.PathLike[str], what: str, fix: str) -> tuple[dict[str, Entry], int]:
    """The validated entries of a safetensors file and where its data section starts (no data read)."""
    path = Path(path)
    with _reported(path, what, fix), open(path, "rb") as handle:
        return _header(handle, path.stat().st_size)


def read_entry(handle: BinaryIO | io.BufferedReader, start: int, name: str, entry: Entry) -> torch.Tensor:
    """One tensor of an open safetensors file, read into a fresh aligned allocation in its stored dtype."""
    dtype, shape, begin, end = entry
    tensor = torch.empty(shape, dtype=dtype)
    if end > begin:
        handle.seek(start + begin)
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy().data)
        done = 0
        while done < end - begin:
            got = handle.readinto(view[done:])  # type: ignore[union-attr]  # every handle here is a buffered file
            if not got:
                raise ValueError(f"the file ends inside tensor {name}")
            done += got
    return tensor
