"""The safetensors reader: same tensors as the safetensors library, aligned, nothing mapped, bad files named."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize.common.errors import QpackError
from quantize.io.tensorfile import check_safetensors, read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.qweight": torch.randint(
            -127, 127, (7, 13), dtype=torch.int8
        ),  # odd sizes: later tensors misaligned
        "a.scale": torch.rand(7, dtype=torch.float16),
        "b.weight": torch.randn(5, 3).to(torch.bfloat16),
        "c.weight": torch.randn(4, 4),
        "d.zero_point": torch.randint(0, 15, (3, 2), dtype=torch.uint8),
        "e.flag": torch.tensor([True, False, True]),
        "f.index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "g.empty": torch.zeros(0, 4),
        "h.scalar": torch.tensor(3.5),
    }


def _write(path: Path, header: dict[str, object], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_reads_what_safetensors_reads_aligned_and_unmapped(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    ours = read_safetensors(path, "weights", "rebuild it")
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(path) not in maps.read_text()  # read into memory, never mapped
    theirs = load_file(str(path))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name
        if ours[name].numel():
            assert ours[name].data_ptr() % 64 == 0, name


def test_bad_headers_name_every_problem(tmp_path: Path) -> None:
    header = {
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "y": {"dtype": "Q4", "shape": [2], "data_offsets": [8, 10]},
        "z": {"dtype": "F32", "shape": [3], "data_offsets": [8, 16]},
        "w": {"dtype": "F32", "shape": [1], "data_offsets": [16, 400]},
    }
    path = _write(tmp_path / "bad.safetensors", header, bytes(16))
    with pytest.raises(QpackError) as caught:
        read_safetensors(path, "artifact weights", "rebuild the artifact")
    message = str(caught.value)
    assert message.startswith(f"artifact weights {path} is corrupt or truncated")
    for expected in ("y: unknown dtype 'Q4'", "z: 8 bytes for shape [3]", "w: bytes 16..400 outside"):
        assert expected in message
    assert message.endswith("; rebuild the artifact") and "\n" not in message


@pytest.mark.parametrize(
    ("header", "data", "expected"),
    [
        (
            {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            bytes(12),
            "4 bytes after the last tensor",
        ),
        (
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            "y: starts at byte 4, the previous tensor ends at 8",
        ),
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_gaps_overlaps_and_non_objects_are_refused(
    tmp_path: Path, header: object, data: bytes, expected: str
) -> None:
    path = _write(tmp_path / "bad.safetensors", header, data)  # type: ignore[arg-type]
    for call in (read_safetensors, check_safetensors):
        with pytest.raises(QpackError, match=expected):
            call(path, "weights", "fix it")


def test_truncated_and_non_safetensors_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])
    with pytest.raises(QpackError, match="corrupt or truncated"):
        read_safetensors(path, "weights", "fix it")
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(QpackError, match="shorter than its 8-byte header"):
        check_safetensors(tmp_path / "short", "weights", "fix it")
    (tmp_path / "huge").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(QpackError, match="header of 1099511627776 bytes"):
        read_safetensors(tmp_path / "huge", "weights", "fix it")
    with pytest.raises(
        QpackError, match=r"missing.safetensors is unreadable \(No such file or directory\); check the path"
    ):
        read_safetensors(tmp_path / "missing.safetensors", "weights", "fix it")
