from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evals.evaluate import EvaluateConfig, Gate, evaluate
from qpack.cli import app
from quantize.common.errors import QpackError
from quantize.config import QuantizeConfig
from quantize.io.artifact import read_manifest, verify_artifact
from quantize.pipeline import quantize_model
from quantize.sensitivity.measure import SensitivityConfig

runner = CliRunner()
SUBSET = "anatomy,marketing,college_physics"


@pytest.fixture()
def artifact(tiny_llama_calibration: Path, tmp_path: Path) -> Path:
    out = tmp_path / "art"
    quantize_model(
        QuantizeConfig(
            output=out,
            calibration=tiny_llama_calibration,
            preset="int4",
            group_size=32,
            algorithm="rtn",
            sensitivity=SensitivityConfig(num_tokens=64),
            calib_tokens=256,
            eval_tokens=128,
        )
    )
    return out


def test_evaluate_writes_results_and_keeps_hashes_valid(artifact: Path, mmlu_dir: Path) -> None:
    result = evaluate(
        EvaluateConfig(
            artifact=artifact, mmlu=mmlu_dir, subjects=SUBSET, limit=4, shots=1, formats=("letter", "cloze")
        )
    )
    assert result.passed and result.reasons == []
    assert set(result.result["formats"]) == {"letter", "cloze"}
    assert result.result["heldout"]["tokens"] > 0 and result.result["reference"]["kind"] == "folder"
    manifest = verify_artifact(artifact)
    mmlu = manifest["evals"]["mmlu"]
    assert mmlu["data_sha256"] == result.result["mmlu"]["sha256"] and mmlu["mmlu"]["questions"] == 12
    assert "kl_values" not in mmlu["formats"]["letter"]
    for name in ("evals/report.md", "evals/drift_letter.png", "evals/answer_kl_cloze.png", "evals/mmlu.json"):
        assert name in manifest["files"] and (artifact / name).is_file()
    report = (artifact / "evals" / "report.md").read_text()
    assert "| letter |" in report and "Held-out calibration queries" in report
    assert mmlu["numerics"]["prefill_dtype"] == "float32" and "prefill GEMMs in float32" in report


def test_the_prefill_dtype_asked_for_is_the_one_evaluated_and_recorded(
    artifact: Path, mmlu_dir: Path
) -> None:
    config = EvaluateConfig(
        artifact=artifact, mmlu=mmlu_dir, subjects="anatomy", limit=2, shots=0, write=False
    )
    runs = {
        dtype: evaluate(dataclasses.replace(config, prefill_dtype=dtype)) for dtype in ("float32", "bfloat16")
    }
    assert {d: r.result["numerics"]["prefill_dtype"] for d, r in runs.items()} == {
        "float32": "float32",
        "bfloat16": "bfloat16",
    }
    assert runs["float32"].result["heldout"]["kl"] != runs["bfloat16"].result["heldout"]["kl"]
    with pytest.raises(QpackError, match="--prefill-dtype must be one of float32, bfloat16"):
        evaluate(dataclasses.replace(config, prefill_dtype="float16"))


def test_gate_fails_with_a_reason_after_writing(artifact: Path, mmlu_dir: Path) -> None:
    result = evaluate(
        EvaluateConfig(
            artifact=artifact,
            mmlu=mmlu_dir,
            subjects=SUBSET,
            limit=3,
            shots=0,
            gate=Gate(max_kl=0.0, max_flip_rate=1.0),
        )
    )
    assert not result.passed and any("held-out next-token KL" in r for r in result.reasons)
    assert read_manifest(artifact)["evals"]["mmlu"]["gate"]["passed"] is False


def test_cli_gate_exit_codes(artifact: Path, mmlu_dir: Path) -> None:
    base = [
        "evaluate",
        str(artifact),
        "--mmlu",
        str(mmlu_dir),
        "--subjects",
        SUBSET,
        "--limit",
        "2",
        "--shots",
        "0",
    ]
    ok = runner.invoke(app, ["--json", *base, "--max-drift", "100", "--max-flip-rate", "1"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["ok"] is True and data["gate"]["passed"] is True
    failed = runner.invoke(app, [*base, "--max-kl", "0"])
    assert failed.exit_code == 1 and "gate failed" in failed.stderr and "--max-kl 0" in failed.stderr
    usage = runner.invoke(app, [*base, "--shots", "9"])
    assert usage.exit_code == 2 and "--shots must be 0..5" in usage.stderr


def test_bad_inputs(artifact: Path, mmlu_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QpackError, match="unknown MMLU subject"):
        evaluate(EvaluateConfig(artifact=artifact, mmlu=mmlu_dir, subjects="astrology"))
    with pytest.raises(QpackError, match=r"calibration directory .* does not exist"):
        evaluate(
            EvaluateConfig(artifact=artifact, mmlu=mmlu_dir, subjects=SUBSET, calibration=tmp_path / "x")
        )
    with pytest.raises(QpackError, match=r"is not a qpack artifact|does not exist"):
        evaluate(EvaluateConfig(artifact=tmp_path, mmlu=mmlu_dir))


def test_build_runs_the_whole_pipeline(
    tiny_llama: Path, mmlu_dir: Path, tmp_path: Path, queries_file: Path
) -> None:
    out = tmp_path / "built"
    args = [
        "--json",
        "build",
        "-m",
        str(tiny_llama),
        "--queries",
        str(queries_file),
        "-n",
        "48",
        "-o",
        str(out),
    ]
    args += [
        "--preset",
        "int8",
        "--mmlu",
        str(mmlu_dir),
        "--subjects",
        SUBSET,
        "--limit",
        "2",
        "--shots",
        "1",
    ]
    result = runner.invoke(app, [*args, "--max-drift", "50"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (
        summary["ok"]
        and summary["gate"]["passed"]
        and set(summary["stages_s"]) == {"calibrate", "quantize", "evaluate"}
    )
    assert (tmp_path / "built.calibration" / "manifest.json").is_file()
    assert verify_artifact(out)["evals"]["mmlu"]["mmlu"]["questions"] == 6
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already exists" in again.stderr
    failed = runner.invoke(app, [*args, "--overwrite", "--max-kl", "0"])
    assert failed.exit_code == 1
    assert json.loads(failed.stdout)["gate"]["passed"] is False


def test_second_run_reuses_the_reference_scores(artifact: Path, mmlu_dir: Path, tmp_path: Path) -> None:
    config = EvaluateConfig(
        artifact=artifact,
        mmlu=mmlu_dir,
        subjects=SUBSET,
        limit=3,
        shots=1,
        cache_dir=tmp_path / "c",
        write=False,
    )
    first = evaluate(config).result
    second = evaluate(config).result
    more = evaluate(dataclasses.replace(config, limit=4)).result
    fresh = evaluate(dataclasses.replace(config, cache=False)).result
    assert first["reference_cache"]["letter"]["questions_from_cache"] == 0
    assert second["reference_cache"]["letter"]["questions_from_cache"] == 9
    assert (
        "mmlu_letter_reference" in first["timings_s"] and "mmlu_letter_reference" not in second["timings_s"]
    )
    assert more["reference_cache"]["letter"]["questions_from_cache"] == 9
    assert fresh["reference_cache"] == {"letter": None}
    for result in (second, fresh):
        assert result["formats"]["letter"]["kl_values"] == first["formats"]["letter"]["kl_values"]
    other_shots = evaluate(dataclasses.replace(config, shots=0)).result
    assert other_shots["reference_cache"]["letter"]["questions_from_cache"] == 0


def test_sequential_gate_stops_early_and_reports_why(
    artifact: Path, mmlu_dir: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import evals.paired

    monkeypatch.setattr(evals.paired, "FIRST_CHUNK", 40)
    lenient = evaluate(
        EvaluateConfig(
            artifact=artifact, mmlu=mmlu_dir, subjects=SUBSET, shots=0, gate=Gate(max_drift=60.0), write=False
        )
    )
    sequential = lenient.result["formats"]["letter"]["sequential"]
    assert lenient.passed and sequential["decisions"]["drift"]["verdict"] == "pass"
    assert sequential["scored"] < sequential["population"] and "decided after" in sequential["stopped"]
    assert lenient.result["formats"]["letter"]["questions"] == sequential["scored"]
    other_model = evaluate(  # a different model (stories260k) as the reference: many answers change
        EvaluateConfig(
            artifact=artifact,
            reference=str(stories_dir),
            mmlu=mmlu_dir,
            subjects=SUBSET,
            shots=0,
            gate=Gate(max_flip_rate=0.01),
            write=False,
        )
    )
    decision = other_model.result["formats"]["letter"]["sequential"]["decisions"]["flips"]
    assert (
        not other_model.passed
        and decision["verdict"] == "fail"
        and "flip rate is in [" in other_model.reasons[0]
    )
    fixed = evaluate(
        EvaluateConfig(
            artifact=artifact,
            mmlu=mmlu_dir,
            subjects=SUBSET,
            limit=2,
            shots=0,
            gate=Gate(max_drift=60.0),
            write=False,
        )
    )
    assert "sequential" not in fixed.result["formats"]["letter"]


def test_compare_table_of_two_artifacts(
    artifact: Path, tiny_llama_calibration: Path, mmlu_dir: Path, tmp_path: Path
) -> None:
    from qpack.compare import CompareConfig, compare

    int8 = tmp_path / "int8"
    quantize_model(
        QuantizeConfig(
            output=int8,
            calibration=tiny_llama_calibration,
            preset="int8",
            algorithm="rtn",
            sensitivity=SensitivityConfig(num_tokens=64),
            calib_tokens=256,
            eval_tokens=128,
        )
    )
    result = compare(
        CompareConfig(
            artifacts=(artifact, int8),
            mmlu=mmlu_dir,
            subjects=SUBSET,
            limit=3,
            shots=1,
            prompt_tokens=16,
            new_tokens=4,
            repeats=1,
            output=tmp_path / "table",
        )
    )
    by_name = {Path(row["artifact"]).name: row for row in result["rows"]}
    assert (
        by_name["art"]["avg_bits"] < by_name["int8"]["avg_bits"]
        and by_name["art"]["bytes"] < by_name["int8"]["bytes"]
    )
    for row in result["rows"]:
        assert (
            row["questions"] == 9
            and row["speed"]["decode_tokens_per_s"] > 0
            and row["heldout_kl"] is not None
        )
    assert by_name["art"]["reference_accuracy"] == by_name["int8"]["reference_accuracy"]
    table = (tmp_path / "table.md").read_text()
    assert (
        table.count("| ") > 10
        and "art" in table
        and json.loads((tmp_path / "table.json").read_text())["rows"]
    )
    out = runner.invoke(app, ["compare", str(artifact), str(tmp_path / "missing"), "--mmlu", str(mmlu_dir)])
    assert out.exit_code != 0 and "is not an artifact" in out.output
