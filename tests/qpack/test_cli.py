from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpack.cli import app
from quantize import __version__

runner = CliRunner()


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("calibrate", "quantize", "evaluate", "serve", "bench", "inspect", "build"):
        assert command in result.output


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_usage_error_exits_2() -> None:
    assert runner.invoke(app, ["calibrate", "--no-such-flag"]).exit_code == 2


def test_calibrate_json_and_errors(tmp_path: Path, tiny_llama: Path) -> None:
    queries = tmp_path / "q.txt"
    queries.write_text("\n".join(f"what is the meaning of item {i} in the list" for i in range(30)))
    args = [
        "calibrate",
        "-m",
        str(tiny_llama),
        "--queries",
        str(queries),
        "-n",
        "12",
        "-o",
        str(tmp_path / "cal"),
    ]
    result = runner.invoke(app, ["--json", *args])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (
        data["ok"] and data["manifest"]["sampling"]["train"] + data["manifest"]["sampling"]["heldout"] == 12
    )

    again = runner.invoke(app, ["--json", *args])
    assert again.exit_code == 2
    error = json.loads(again.stdout)
    assert error["ok"] is False and "already exists" in error["error"]

    table = runner.invoke(app, [*args, "--overwrite"])
    assert table.exit_code == 0 and "Cleaning" in table.stdout and "kept (sampling pool)" in table.stdout

    assert "already exists; set --overwrite" in error["error"]

    missing = runner.invoke(
        app, ["calibrate", "--queries", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "x")]
    )
    assert (
        missing.exit_code == 2 and "--queries file" in missing.stderr and "does not exist" in missing.stderr
    )
    assert "Traceback" not in missing.output
    bad = runner.invoke(app, ["calibrate", "--turns", "some", "-n", "0", "--max-tokens", "2"])
    assert bad.exit_code == 2
    assert (
        "invalid calibration options: --turns must be one of first, all (got 'some'); --num-samples must be at "
        "least 1 (got 0); --max-tokens (2) must be at least --min-tokens (4)" in " ".join(bad.stderr.split())
    )


def test_quantize_and_inspect(tmp_path: Path, tiny_llama: Path, tiny_llama_calibration: Path) -> None:
    art = tmp_path / "art"
    args = [
        "quantize",
        "-c",
        str(tiny_llama_calibration),
        "-o",
        str(art),
        "--preset",
        "int8",
        "--name",
        "tiny",
    ]
    result = runner.invoke(app, ["--json", *args, "--sensitivity-tokens", "64", "--calib-tokens", "256"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["manifest"]["name"] == "tiny" and data["manifest"]["quality"]["kl"] < 0.01
    assert data["manifest"]["quality"]["numerics"]["prefill_dtype"] == "float32"
    table = runner.invoke(app, ["inspect", str(art)])
    assert table.exit_code == 0 and "sha256 verified" in table.stdout and "tiny v1" in table.stdout
    raw = runner.invoke(app, ["--json", "inspect", str(art)])
    assert json.loads(raw.stdout)["format"] == "qpack.artifact"
    missing = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    bad = runner.invoke(app, ["quantize", "-c", str(tmp_path / "nocal"), "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "calibration directory" in bad.stderr
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already exists" in again.stderr


def test_quantize_reports_every_bad_option_at_once_by_its_flag(
    tmp_path: Path, tiny_llama_calibration: Path
) -> None:
    bad = {
        "--preset": "int2",
        "--scheme": "int5",
        "--group-size": "48",
        "--damp": "2",
        "--target-bits": "40",
        "--sensitivity": "guess",
        "--max-shard-size": "1KB",
        "--max-memory": "lots",
        "--override": "nonsense",
        "--distill-minutes": "0",
    }
    args = ["--json", "quantize", "-c", str(tiny_llama_calibration), "-o", str(tmp_path / "art")]
    result = runner.invoke(app, [*args, *(part for pair in bad.items() for part in pair), "--distill"])
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert error.startswith("invalid quantize options: ")
    for fragment in (
        "--preset must be one of int8, int4, mixed, w8a8 (got 'int2')",
        "--scheme unknown scheme 'int5'",
        "--group-size must be one of 32, 64, 128 (got 48)",
        "--target-bits must be in [2, 32] (got 40.0)",
        "--damp must be in (0, 1) (got 2.0)",
        "--sensitivity must be one of auto, kl, kl-all, fisher, mse (got 'guess')",
        "--max-shard-size must be at least 16 KiB (got 1000 bytes)",
        "--max-memory 'lots' is not a size",
        "--override 'nonsense' is not PATTERN=SCHEME",
        "--distill-minutes must be > 0 (got 0.0)",
    ):
        assert fragment in error, fragment
    assert not (tmp_path / "art").exists()


def test_serve_reports_every_bad_option_at_once(tiny_llama: Path) -> None:
    result = runner.invoke(
        app,
        [
            "--json",
            "serve",
            str(tiny_llama),
            "--block-size",
            "0",
            "--kv-dtype",
            "int3",
            "--port",
            "0",
            "--prefill-dtype",
            "float16",
        ],
    )
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert "--block-size" in error and "--kv-dtype must be one of float32, bfloat16, float16" in error
    assert (
        "--port" in error
        and "--prefill-dtype must be one of float32, bfloat16, int8 (got 'float16')" in error
    )


def test_serving_an_artifact_without_its_manifest_exits_2(tiny_qwen2_artifact: Path, copy_dir) -> None:
    folder = copy_dir(tiny_qwen2_artifact, "damaged")
    (folder / "manifest.json").unlink()
    result = runner.invoke(app, ["serve", str(folder), "--port", "8123"])
    assert (
        result.exit_code == 2 and "damaged artifact" in result.stderr and len(result.stderr.splitlines()) <= 3
    )


def test_third_party_warnings_stay_off_the_terminal(monkeypatch) -> None:
    import warnings

    import quantize.model.sources
    from qpack.cli import _third_party_warnings_off

    shown: list[str] = []
    monkeypatch.delenv("QPACK_SHOW_WARNINGS", raising=False)
    monkeypatch.setattr(
        warnings, "showwarning", lambda message, *_args, **_kwargs: shown.append(str(message))
    )
    _third_party_warnings_off()
    warnings.showwarning("from a library", UserWarning, "/somewhere/site-packages/torch/x.py", 1)
    warnings.showwarning("from qpack", UserWarning, quantize.model.sources.__file__, 1)
    assert shown == ["from qpack"]


def test_tables_in_a_log_are_whole(tmp_path: Path) -> None:
    """Output to a file or pipe (CI logs) renders at COLUMNS or 160 columns, not 80: a wide table keeps every
    cell whole and the log is valid UTF-8."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # explicit: the C environment may differ
    script = (
        "from rich.table import Table; from qpack.console import Output; t = Table(title='grid'); "
        "[t.add_column(f'column number {i}') for i in range(8)]; "
        "t.add_row(*[f'value-{i}-abcdefgh' for i in range(8)]); Output().result({}, t)"
    )
    log = tmp_path / "log.txt"
    with open(log, "wb") as handle:
        subprocess.run([sys.executable, "-c", script], stdout=handle, check=True, env=env, timeout=120)
    text = log.read_bytes().decode("utf-8")  # raises on a cut multi-byte character
    assert all(f"value-{i}-abcdefgh" in text for i in range(8)) and "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 160
    narrow = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        check=True,
        env={**env, "COLUMNS": "100"},
        timeout=120,
    )
    assert max(len(line) for line in narrow.stdout.decode().splitlines()) <= 100


def test_serve_batch_invariant_refuses_what_the_native_step_cant_run(tiny_llama: Path) -> None:
    result = runner.invoke(
        app, ["--json", "serve", str(tiny_llama), "--dtype", "bfloat16", "--batch-invariant", "--port", "1"]
    )
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert "--batch-invariant: the fused step can't run layers 0, 1" in error
    assert "the embeddings and LM head must be FP32" in error and "serve without --batch-invariant" in error


def test_quantize_mixed_then_distill_from_the_command_line(
    tmp_path: Path, tiny_llama_calibration: Path
) -> None:
    """`--preset mixed --distill` plans, quantizes, then distills: the manifest records the distillation and its
    settings from the flags, and the artifact verifies."""
    art = tmp_path / "art"
    args = ["--json", "quantize", "-c", str(tiny_llama_calibration), "-o", str(art), "--preset", "mixed"]
    flags = ["--distill", "--distill-minutes", "0.3", "--distill-lr", "0.004", "--calib-tokens", "2048"]
    result = runner.invoke(app, [*args, "--sensitivity-tokens", "64", *flags])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)["manifest"]
    section = manifest["quantization"]["distill"]
    assert section["settings"]["minutes"] == 0.3 and section["settings"]["lr"] == 0.004
    assert section["heldout_kl"] == pytest.approx(manifest["quality"]["kl"])
    assert section["validation_kl"] <= section["validation_kl_before"]
    assert "distill.png" in manifest["files"]
    assert runner.invoke(app, ["inspect", str(art)]).exit_code == 0


def test_the_option_reference_is_generated_from_the_command_line() -> None:
    """docs/cli.md is what `python -m qpack.cli.reference --write` writes from the CLI now: an option added,
    renamed or re-documented without regenerating it fails here, naming the fix."""
    from qpack.cli.reference import REFERENCE, render

    text = render()
    assert "## `qpack serve`" in text and "`--prefill-dtype`" in text and "## `qpack bench decode`" in text
    assert REFERENCE.read_text() == text, "docs/cli.md is stale: run `python -m qpack.cli.reference --write`"
