"""`qpack evaluate` updates an artifact atomically: killed at any write, or at any moment, the artifact still
verifies and holds either the previous evaluation or the new one, whole; concurrent updates wait for each other."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from evals.config import EvaluateConfig
from evals.pipeline import evaluate
from evals.store import commit_reports
from quantize.common.errors import QpackError
from quantize.io.artifact import content_sha256, read_manifest, update_manifest, verify_artifact

HARNESS = Path(__file__).with_name("kill_harness.py")
REPO = Path(__file__).resolve().parents[2]
OLD = dict(subjects="anatomy", limit=2, shots=0)  # 2 questions
NEW_ARGS = ["--subjects", "marketing", "--limit", "1", "--shots", "0", "--heldout-tokens", "64"]  # 1 question
REPORTS = {"report.md", "mmlu.json", "drift_letter.png", "answer_kl_letter.png"}


def _environment(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "QPACK_CACHE_DIR": str(tmp_path / "qpack-cache"),
        "QPACK_NATIVE": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def _evaluated_before(artifact: Path, mmlu_dir: Path) -> dict[str, Any]:
    evaluate(EvaluateConfig(artifact=artifact, mmlu=mmlu_dir, **OLD))
    return dict(read_manifest(artifact)["evals"]["mmlu"])


def _which(artifact: Path, old: dict[str, Any]) -> str:
    """'old' or 'new': the evaluation the artifact holds, after checking it verifies and is whole."""
    manifest = verify_artifact(artifact)
    section = manifest["evals"]["mmlu"]
    listed = {name for name in manifest["files"] if name.startswith("evals/")}
    assert listed == {f"{section['report_dir']}/{name}" for name in REPORTS}
    written = json.loads((artifact / section["report_dir"] / "mmlu.json").read_text())
    assert written == {k: v for k, v in section.items() if k not in ("summary", "data_sha256", "report_dir")}
    if section == old:
        return "old"
    assert section["mmlu"]["questions"] == 1 and section["report_dir"] != old["report_dir"]
    return "new"


def test_a_kill_at_any_write_leaves_the_old_or_the_new_evaluation(
    artifact: Path, mmlu_dir: Path, tmp_path: Path
) -> None:
    old = _evaluated_before(artifact, mmlu_dir)
    work = tmp_path / "runs"
    work.mkdir()
    argv = ["--json", "evaluate", "{artifact}", "--mmlu", str(mmlu_dir), *NEW_ARGS]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"template": str(artifact), "work": str(work), "argv": argv}))
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(plan)],
        env=_environment(tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads((work / "runs.json").read_text())
    changes = [tuple(change) for change in outcome["changes"]]
    runs = {int(n): ended for n, ended in outcome["runs"].items()}
    assert runs[0] == "exit 0", (work / "0.log").read_text()[-3000:]
    assert {"create", "open", "write", "chmod", "rename", "mkdir", "remove", "rmdir"} <= {
        op for op, _ in changes
    }
    commit = changes.index(("rename", "manifest.json")) + 1
    previous = old["report_dir"]
    assert ("rmdir", previous) in changes[commit:], "the previous report folder goes only after the commit"
    assert sorted(runs) == list(range(len(changes) + 1))
    for n in range(1, len(changes) + 1):
        assert runs[n] == "killed", (n, changes[n - 1], (work / f"{n}.log").read_text()[-2000:])
        held = _which(work / str(n), old)
        assert held == ("old" if n <= commit else "new"), (n, changes[n - 1])
    assert _which(work / "0", old) == "new"
    assert [p.name for p in (work / "0" / "evals").iterdir()] == [
        Path(read_manifest(work / "0")["evals"]["mmlu"]["report_dir"]).name
    ]

    killed_before_commit = work / str(commit)
    leftovers = {p.name for p in (killed_before_commit / "evals").iterdir()}
    assert len(leftovers) == 2 and Path(previous).name in leftovers
    assert list(killed_before_commit.glob(".manifest.json.*.tmp"))
    again = evaluate(EvaluateConfig(artifact=killed_before_commit, mmlu=mmlu_dir, **OLD))
    assert again.report_dir is not None
    assert [p.name for p in (killed_before_commit / "evals").iterdir()] == [again.report_dir.name]
    assert not list(killed_before_commit.glob(".manifest.json.*.tmp"))
    verify_artifact(killed_before_commit)


def test_a_sigkill_at_a_random_moment_of_qpack_evaluate(
    artifact: Path, mmlu_dir: Path, tmp_path: Path
) -> None:
    old = _evaluated_before(artifact, mmlu_dir)
    timed = tmp_path / "timed"
    shutil.copytree(artifact, timed)

    def command(target: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "qpack",
            "--json",
            "evaluate",
            str(target),
            "--mmlu",
            str(mmlu_dir),
            *NEW_ARGS,
        ]

    started = time.monotonic()
    subprocess.run(
        command(timed), env=_environment(tmp_path), cwd=REPO, capture_output=True, check=True, timeout=600
    )
    duration = time.monotonic() - started
    assert _which(timed, old) == "new"
    delay = random.uniform(0, duration)
    process = subprocess.Popen(
        command(artifact),
        env=_environment(tmp_path),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    held = _which(artifact, old)  # verifies, whole
    assert held == "new" or process.returncode == -signal.SIGKILL, (delay, duration, process.returncode)


def test_an_update_waits_for_the_lock_and_none_is_lost(artifact: Path, mmlu_dir: Path) -> None:
    _evaluated_before(artifact, mmlu_dir)
    identity = content_sha256(read_manifest(artifact))
    finished: list[Path] = []

    def commit(label: str) -> None:
        files = {"report.md": label.encode(), "mmlu.json": b"{}"}
        finished.append(commit_reports(artifact, identity, files, {"label": label}))

    with update_manifest(artifact) as update:
        waiting = threading.Thread(target=commit, args=("waiting",))
        waiting.start()
        time.sleep(0.5)
        assert not finished, "a commit went ahead while another update held the artifact's lock"
        update.commit({**update.manifest, "evals": {**update.manifest["evals"], "other": {"kept": True}}})
    waiting.join(timeout=30)
    assert finished
    racing = [threading.Thread(target=commit, args=(f"racer {i}",)) for i in range(4)]
    for thread in racing:
        thread.start()
    for thread in racing:
        thread.join(timeout=30)
    manifest = verify_artifact(artifact)
    assert manifest["evals"]["other"] == {"kept": True}, "an update made under the lock was lost"
    assert len(finished) == 5
    current = artifact / manifest["evals"]["mmlu"]["report_dir"]
    assert current in finished and manifest["evals"]["mmlu"]["label"] == (current / "report.md").read_text()
    assert [p.name for p in (artifact / "evals").iterdir()] == [current.name]


def test_a_commit_into_a_rebuilt_artifact_is_refused(artifact: Path, mmlu_dir: Path) -> None:
    old = _evaluated_before(artifact, mmlu_dir)
    with pytest.raises(QpackError, match="changed while it was evaluated"):
        commit_reports(artifact, "0" * 64, {"report.md": b"stale"}, {"label": "stale"})
    assert _which(artifact, old) == "old"
    assert len(list((artifact / "evals").iterdir())) == 1
