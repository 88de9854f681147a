from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from evals.config import EvaluateConfig, Gate
from evals.pipeline import evaluate
from evals.results import Evaluation
from qpack.cli import app
from quantize.common.config import ConfigError, field_docs
from quantize.common.errors import QpackError
from quantize.io.artifact import read_manifest, verify_artifact

runner = CliRunner()
SUBSET = "anatomy,marketing,college_physics"

# The JSON of an evaluation as CI steps and existing artifacts read it: the keys of each object, by where it is.
SCHEMA = {
    "": {
        "artifact",
        "reference",
        "numerics",
        "mmlu",
        "formats",
        "heldout",
        "heldout_note",
        "items_per_second",
        "reference_cache",
        "reference_loaded",
        "timings_s",
        "gate",
        "evaluated_at",
        "seconds",
    },
    "artifact": {"name", "version", "path"},
    "reference": {"id", "kind", "weights_sha256", "content_sha256"},
    "numerics": {"prefill_dtype", "native_kernels", "prompt_path"},
    "mmlu": {"layout", "source", "sha256", "subjects", "questions", "shots", "limit"},
    "format": {
        "questions",
        "reference",
        "candidate",
        "drift_points",
        "drift_ci95_points",
        "flips",
        "answer_kl",
        "top1_agreement",
        "subjects",
    },
    "accuracy": {"accuracy", "ci95", "correct", "total"},
    "flips": {"right_to_wrong", "wrong_to_right", "changed", "flip_rate"},
    "answer_kl": {"mean", "p95"},
    "subject": {"n", "reference", "candidate", "drift_points", "drift_ci95_points", "flips"},
    "heldout": {
        "tokens",
        "kl",
        "kl_p95",
        "top1_agreement",
        "ppl_reference",
        "ppl",
        "calibration_manifest_sha256",
        "reference_hidden",
    },
    "reference_cache": {"path", "questions_from_cache"},
    "gate": {"checked", "passed", "reasons"},
    "sequential": {
        "confidence",
        "method",
        "population",
        "scored",
        "questions_needed",
        "stopped",
        "decisions",
        "undecided",
        "drop_interval_points",
        "flip_rate_interval",
    },
    "decision": {"verdict", "questions", "interval", "threshold"},
}


def assert_schema(data: dict[str, Any], sequential: bool = False) -> None:
    """`data` (an evaluation's JSON) has exactly the keys of SCHEMA, with lists where intervals are."""
    assert set(data) == SCHEMA[""]
    for key in ("artifact", "reference", "numerics", "mmlu", "gate"):
        assert set(data[key]) == SCHEMA[key], key
    if data["heldout"] is not None:
        assert set(data["heldout"]) == SCHEMA["heldout"]
    for cache in data["reference_cache"].values():
        assert cache is None or set(cache) == SCHEMA["reference_cache"]
    for report in data["formats"].values():
        assert set(report) == SCHEMA["format"] | ({"sequential"} if sequential else set())
        for key in ("reference", "candidate"):
            assert set(report[key]) == SCHEMA["accuracy"] and isinstance(report[key]["ci95"], list)
        assert set(report["flips"]) == SCHEMA["flips"] and set(report["answer_kl"]) == SCHEMA["answer_kl"]
        assert isinstance(report["drift_ci95_points"], list) and report["subjects"]
        for subject in report["subjects"].values():
            assert set(subject) == SCHEMA["subject"]
        if sequential:
            assert set(report["sequential"]) == SCHEMA["sequential"]
            for decision in report["sequential"]["decisions"].values():
                assert set(decision) == SCHEMA["decision"] and isinstance(decision["interval"], list)


def test_evaluate_writes_results_and_keeps_hashes_valid(artifact: Path, mmlu_dir: Path) -> None:
    result = evaluate(
        EvaluateConfig(
            artifact=artifact, mmlu=mmlu_dir, subjects=SUBSET, limit=4, shots=1, formats=("letter", "cloze")
        )
    )
    evaluation = result.evaluation
    assert result.passed and result.reasons == []
    assert set(evaluation.formats) == {"letter", "cloze"}
    assert evaluation.heldout is not None and evaluation.heldout.tokens > 0
    assert evaluation.reference.kind == "folder"
    manifest = verify_artifact(artifact)
    mmlu = manifest["evals"]["mmlu"]
    assert result.report_dir is not None and result.report_dir.parent == artifact.resolve() / "evals"
    assert mmlu["report_dir"] == f"evals/{result.report_dir.name}"
    assert mmlu["data_sha256"] == evaluation.mmlu.sha256 and mmlu["mmlu"]["questions"] == 12
    assert {k: v for k, v in mmlu.items() if k not in ("summary", "data_sha256", "report_dir")} == json.loads(
        (result.report_dir / "mmlu.json").read_text()
    )
    assert_schema(json.loads((result.report_dir / "mmlu.json").read_text()))
    listed = sorted(name for name in manifest["files"] if name.startswith("evals/"))
    assert listed == sorted(
        f"{mmlu['report_dir']}/{name}"
        for name in (
            "report.md",
            "mmlu.json",
            *(f"{k}_{f}.png" for k in ("drift", "answer_kl") for f in ("letter", "cloze")),
        )
    )
    assert sorted(p.name for p in (artifact / "evals").iterdir()) == [result.report_dir.name]
    report = (result.report_dir / "report.md").read_text()
    assert "| letter |" in report and "Held-out calibration queries" in report
    assert mmlu["numerics"]["prefill_dtype"] == "float32" and "prefill GEMMs in float32" in report


def test_reevaluating_replaces_the_report_folder_and_the_flat_layout(artifact: Path, mmlu_dir: Path) -> None:
    config = EvaluateConfig(artifact=artifact, mmlu=mmlu_dir, subjects="anatomy", limit=2, shots=0)
    first = evaluate(config).report_dir
    assert first is not None
    flat = artifact / "evals"  # as artifacts evaluated before report folders hold them: evals/report.md ...
    manifest = read_manifest(artifact)
    for path in first.iterdir():
        path.rename(flat / path.name)
    first.rmdir()
    manifest["files"] = {
        name.replace(f"evals/{first.name}/", "evals/"): h for name, h in manifest["files"].items()
    }
    del manifest["evals"]["mmlu"]["report_dir"]
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    verify_artifact(artifact)
    second = evaluate(dataclasses.replace(config, limit=3)).report_dir
    assert second is not None and second != first
    assert [p.name for p in flat.iterdir()] == [second.name]
    assert verify_artifact(artifact)["evals"]["mmlu"]["mmlu"]["questions"] == 3
    third = evaluate(config).report_dir
    assert third is not None and [p.name for p in flat.iterdir()] == [third.name] and third != second


def test_the_prefill_dtype_asked_for_is_the_one_evaluated_and_recorded(
    artifact: Path, mmlu_dir: Path
) -> None:
    config = EvaluateConfig(
        artifact=artifact, mmlu=mmlu_dir, subjects="anatomy", limit=2, shots=0, write=False
    )
    runs = {
        dtype: evaluate(dataclasses.replace(config, prefill_dtype=dtype)).evaluation
        for dtype in ("float32", "bfloat16")
    }
    assert {d: r.numerics.prefill_dtype for d, r in runs.items()} == {
        "float32": "float32",
        "bfloat16": "bfloat16",
    }
    kl = {d: r.heldout.kl for d, r in runs.items() if r.heldout is not None}
    assert len(kl) == 2 and kl["float32"] != kl["bfloat16"]
    with pytest.raises(ConfigError, match="prefill_dtype must be one of float32, bfloat16, int8"):
        evaluate(dataclasses.replace(config, prefill_dtype="float16"))


def test_every_problem_is_named_by_its_field_at_once(tmp_path: Path) -> None:
    config = EvaluateConfig(
        artifact=tmp_path,
        shots=7,
        formats=("letter", "essay"),
        limit=0,
        gate=Gate(max_drift=-1.0, max_flip_rate=-0.5),
        confidence=1.0,
        token_budget=100,
        max_questions=0,
    )
    with pytest.raises(ConfigError) as raised:
        config.validate()
    assert str(raised.value) == (
        "invalid EvaluateConfig: shots must be 0..5 (got 7); formats must be one of letter, cloze (got 'essay'); "
        "limit must be at least 1 (got 0); gate.max_drift must be >= 0 (got -1.0); "
        "gate.max_flip_rate must be >= 0 (got -0.5); max_questions must be at least 1 (got 0); "
        "confidence must be in [0.5, 1) (got 1.0); token_budget must be at least 256 (got 100)"
    )
    assert [p.field for p in raised.value.problems][:3] == ["shots", "formats", "limit"]
    with pytest.raises(ConfigError, match="formats must name at least one of letter, cloze"):
        EvaluateConfig(artifact=tmp_path, formats=()).validate()
    EvaluateConfig(artifact=tmp_path).validate()


def test_every_field_is_documented() -> None:
    for config in (EvaluateConfig, Gate):
        docs = field_docs(config)
        assert set(docs) == {f.name for f in dataclasses.fields(config)}, config
        assert all(doc.strip() for doc in docs.values())


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
    assert result.evaluation.gate.checked == ("max_kl=0.0", "max_flip_rate=1.0")
    assert read_manifest(artifact)["evals"]["mmlu"]["gate"] == {
        "checked": ["max_kl=0.0", "max_flip_rate=1.0"],
        "passed": False,
        "reasons": result.reasons,
    }


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
    assert set(data) == SCHEMA[""] | {"ok", "report_dir"}
    assert Path(data["report_dir"]).parent == artifact.resolve() / "evals"
    assert (Path(data["report_dir"]) / "report.md").is_file()
    assert json.loads((Path(data["report_dir"]) / "mmlu.json").read_text())["formats"] == data["formats"]
    failed = runner.invoke(app, [*base, "--max-kl", "0"])
    assert failed.exit_code == 1 and "gate failed" in failed.stderr and "--max-kl 0" in failed.stderr
    usage = runner.invoke(app, [*base, "--shots", "9", "--batch-tokens", "100", "--max-drift", "-1"])
    assert usage.exit_code == 2
    assert (
        "invalid evaluate options: --shots must be 0..5 (got 9); --max-drift must be >= 0 (got -1.0); "
        "--batch-tokens must be at least 256 (got 100)"
    ) in " ".join(usage.stderr.split())


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
    bad = runner.invoke(app, [*args, "--shots", "9", "--max-drift", "-1", "--preset", "int3"])
    assert bad.exit_code == 2 and json.loads(bad.stdout)["error"] == (
        "invalid build options: --preset must be one of int8, int4, mixed, w8a8 (got 'int3'); "
        "--shots must be 0..5 (got 9); --max-drift must be >= 0 (got -1.0)"
    )
    assert not any(tmp_path.glob("built*")), "a bad evaluate option stops the build before it calibrates"
    result = runner.invoke(app, [*args, "--max-drift", "50"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (
        summary["ok"]
        and summary["gate"] == {"checked": ["max_drift=50.0"], "passed": True, "reasons": []}
        and set(summary["stages_s"]) == {"calibrate", "quantize", "evaluate"}
    )
    assert set(summary["mmlu"]["letter"]) == {
        "reference_accuracy",
        "accuracy",
        "drift_points",
        "drift_ci95_points",
        "flip_rate",
        "answer_kl",
    }
    assert set(summary["heldout"]) == SCHEMA["heldout"]
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
    first = evaluate(config).evaluation
    second = evaluate(config).evaluation
    more = evaluate(dataclasses.replace(config, limit=4)).evaluation
    fresh = evaluate(dataclasses.replace(config, cache=False)).evaluation

    def from_cache(evaluation: Evaluation) -> int:
        cache = evaluation.reference_cache["letter"]
        assert cache is not None and Path(cache.path).is_relative_to(tmp_path / "c")
        return int(cache.questions_from_cache)

    assert (from_cache(first), from_cache(second), from_cache(more)) == (0, 9, 9)
    assert "mmlu_letter_reference" in first.timings_s and "mmlu_letter_reference" not in second.timings_s
    assert fresh.reference_cache == {"letter": None} and fresh.to_json()["reference_cache"] == {
        "letter": None
    }
    for evaluation in (second, fresh):
        assert evaluation.formats["letter"].kl_values == first.formats["letter"].kl_values
    assert from_cache(evaluate(dataclasses.replace(config, shots=0)).evaluation) == 0


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
    sequential = lenient.evaluation.formats["letter"].sequential
    assert sequential is not None
    assert lenient.passed and sequential.decisions["drift"].verdict == "pass"
    assert sequential.decisions["drift"].threshold == 60.0
    assert sequential.scored < sequential.population and "decided after" in sequential.stopped
    assert lenient.evaluation.formats["letter"].questions == sequential.scored
    assert_schema(lenient.evaluation.to_json(), sequential=True)
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
    other = other_model.evaluation.formats["letter"].sequential
    assert other is not None and other.decisions["flips"].verdict == "fail"
    assert not other_model.passed and "flip rate is in [" in other_model.reasons[0]
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
    assert fixed.evaluation.formats["letter"].sequential is None
    assert "sequential" not in fixed.evaluation.to_json()["formats"]["letter"]


def test_compare_table_of_two_artifacts(
    artifact: Path, make_artifact: Callable[[str, str], Path], mmlu_dir: Path, tmp_path: Path
) -> None:
    from qpack.compare import CompareConfig, compare

    int8 = make_artifact("int8", "int8")
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
            and row["numerics"]["prefill_dtype"] == "float32"
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
    usage = runner.invoke(app, ["compare", str(artifact), "--mmlu", str(mmlu_dir), "--shots", "6"])
    assert usage.exit_code == 2 and "invalid compare options: --shots must be 0..5 (got 6)" in usage.output


def test_a_rotated_artifact_is_evaluated_against_its_unrotated_original(
    stories_calibration: Path, mmlu_dir: Path, tmp_path: Path
) -> None:
    """`--rotate` changes every stored weight, the embedding and the head; the reference is still the original
    checkpoint, so a rotation that evaluate did not see through would show as a large KL."""
    from quantize.algorithms import RTN
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS

    out = tmp_path / "rotated"
    quantized = quantize_model(
        QuantizeConfig(
            output=out,
            calibration=stories_calibration,
            preset=PRESETS["int8"],
            algorithm=RTN(),
            rotate="hadamard",
            calib_tokens=256,
            eval_tokens=128,
        )
    )
    result = evaluate(EvaluateConfig(artifact=out, mmlu=mmlu_dir, subjects="anatomy", limit=8, shots=0))
    heldout = result.evaluation.heldout
    assert heldout is not None and heldout.kl == pytest.approx(quantized.quality.kl, rel=0.1, abs=1e-4)
    assert heldout.kl < 0.05 and heldout.top1_agreement > 0.85
    letter = result.evaluation.formats["letter"]
    assert letter.questions == 8 and letter.answer_kl.mean < 0.05
    assert read_manifest(out)["quantization"]["rotation"]["kind"] == "hadamard"
    assert verify_artifact(out)["evals"]["mmlu"]["mmlu"]["questions"] == 8
