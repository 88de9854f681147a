"""Atomic outputs: a writer killed with SIGKILL leaves a partial that the next write to the same output
removes; a live writer's partial is left alone; outputs carry the user's umask."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from quantize.common.fileio import atomic_output_dir, partial_dir, remove_stale_partials, write_json


def test_a_killed_writers_partial_is_removed_by_the_next_write(tmp_path: Path) -> None:
    out = tmp_path / "artifact"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from quantize.common.fileio import partial_dir; "
            f"p = partial_dir(Path({str(out)!r})); (p / 'model.safetensors').write_bytes(b'x' * 1000); "
            "print(p, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    stale = Path(writer.stdout.readline().strip())
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert stale.is_dir()  # SIGKILL: nothing could clean up
    live = partial_dir(out)  # this process is alive: its partial must survive another writer's clean-up
    with atomic_output_dir(out, overwrite=False, what="artifact directory") as tmp:
        (tmp / "a.txt").write_text("done")
    assert not stale.exists() and live.is_dir()
    assert (out / "a.txt").read_text() == "done"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, live.name, live.name + ".owner"])
    remove_stale_partials(out)
    assert live.is_dir()


def test_a_partial_without_owner_record_is_removed_only_when_old(tmp_path: Path) -> None:
    out = tmp_path / "cal"
    fresh, old = tmp_path / ".cal.aaaa.partial", tmp_path / ".cal.bbbb.partial"
    fresh.mkdir()
    old.mkdir()
    os.utime(old, (1, 1))
    assert remove_stale_partials(out) == [old] and fresh.is_dir()


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_outputs_carry_the_users_umask(tmp_path: Path, mask: int) -> None:
    previous = os.umask(mask)
    try:
        out = tmp_path / f"out{mask}"
        with atomic_output_dir(out, overwrite=False, what="artifact directory") as tmp:
            write_json(tmp / "manifest.json", {"ok": True})
            (tmp / "weights.bin").write_bytes(b"w")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((out / "manifest.json").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((out / "weights.bin").stat().st_mode) == 0o666 & ~mask
