"""Evaluation reports committed into an artifact in one atomic step: a kill at any moment leaves an artifact that
verifies, holding either the previous evaluation or the new one, whole.

An artifact is trusted only while every file its manifest lists has the hash listed (`verify_artifact`, before
every `qpack serve` and `inspect`). Rewriting the reports in place and then the manifest's hashes would leave,
after a SIGKILL between the two, an artifact that is refused from then on. So each evaluation writes its reports
into a fresh folder, `ARTIFACT/evals/mmlu-<UTC time>-<random>/`, that no manifest lists yet and that is never
modified afterwards. The commit is a single atomic step, the replacement of manifest.json (temp file + rename),
after which its `files` and its `evals.mmlu` section (`report_dir`: `evals/mmlu-...`) name the new folder instead
of the previous one. Only then is the previous folder removed, with whatever killed runs left behind (folders
under `evals/` that no manifest lists, temp files of the manifest). The reports of an artifact are therefore
always at `ARTIFACT/<evals.mmlu.report_dir>/`: report.md, mmlu.json, and drift_<format>.png and
answer_kl_<format>.png for each format; `evals/` holds nothing else once an evaluation has finished.

All of it happens under the artifact's lock (`quantize.io.artifact.update_manifest`): two evaluations at once
commit one after the other (the later one's reports are the artifact's), neither removes the folder the other is
about to commit, and the commit is refused when the artifact's weights, config or tokenizer changed since they
were evaluated (the artifact was rebuilt in between).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from quantize.common.errors import QpackError
from quantize.common.fileio import sha256_file, umask, write_bytes
from quantize.io.artifact import MANIFEST_FILE, content_sha256, update_manifest

REPORT_DIR = "evals"
SECTION = "mmlu"


def commit_reports(
    root: Path, evaluated_sha256: str, files: dict[str, bytes], section: dict[str, Any]
) -> Path:
    """Write `files` ({name: data}) into a fresh report folder of the artifact at `root` and commit them with the
    manifest section `evals.mmlu` (`section` with `report_dir` added); returns the folder.

    `evaluated_sha256`: the `content_sha256` of the manifest that was evaluated."""
    with update_manifest(root) as update:
        if content_sha256(update.manifest) != evaluated_sha256:
            raise QpackError(
                f"artifact {root} changed while it was evaluated (its weights, config or tokenizer are not the "
                "ones scored); nothing was written; evaluate it again"
            )
        folder = _fresh_folder(root)
        hashes = {}
        for name, data in files.items():
            write_bytes(folder / name, data)
            hashes[f"{REPORT_DIR}/{folder.name}/{name}"] = sha256_file(folder / name)
        manifest = update.manifest
        kept = {
            name: digest
            for name, digest in manifest.get("files", {}).items()
            if not name.startswith(f"{REPORT_DIR}/")
        }
        evals = {
            **manifest.get("evals", {}),
            SECTION: {**section, "report_dir": f"{REPORT_DIR}/{folder.name}"},
        }
        update.commit({**manifest, "files": {**kept, **hashes}, "evals": evals})
        _remove_unlisted(root, update.manifest)
    return folder


def _fresh_folder(root: Path) -> Path:
    (root / REPORT_DIR).mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = Path(tempfile.mkdtemp(prefix=f"{SECTION}-{stamp}-", dir=root / REPORT_DIR))
    os.chmod(folder, 0o777 & ~umask())
    return folder


def _remove_unlisted(root: Path, manifest: dict[str, Any]) -> None:
    """Remove what `manifest` does not list under ROOT/evals (the previous run, runs killed before their commit,
    the reports of artifacts evaluated before report folders existed) and the manifest's own temp files. Only
    under the artifact's lock: unlisted is then never a run still being written."""
    listed = {name.split("/")[1] for name in manifest.get("files", {}) if name.startswith(f"{REPORT_DIR}/")}
    folder = root / REPORT_DIR
    stale = [path for path in folder.iterdir() if path.name not in listed] if folder.is_dir() else []
    stale += root.glob(f".{MANIFEST_FILE}.*.tmp")
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
