"""The model an artifact is evaluated against: its identity (what cached reference results are keyed by) and
the model itself, loaded only when something is not in the caches (for a 7B FP32 reference, tens of GB and
minutes saved per CI run)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from evals.results import ReferenceInfo
from quantize.common.errors import QpackError
from quantize.common.progress import Progress
from quantize.io.artifact import FORMAT as ARTIFACT_FORMAT
from quantize.io.artifact import MANIFEST_FILE, content_sha256, load_artifact, read_manifest, verify_artifact
from quantize.model.sources import load_model, resolve_model, weights_sha256


class LazyReference:
    """The reference model, loaded on first use."""

    def __init__(self, load: Callable[[], nn.Module], progress: Progress) -> None:
        self._load = load
        self._model: nn.Module | None = None
        self.progress = progress

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def get(self) -> nn.Module:
        if self._model is None:
            with self.progress.task("Loading the reference model"):
                self._model = self._load()
        return self._model


def _is_artifact(spec: str) -> bool:
    path = Path(spec).expanduser()
    if not (path / MANIFEST_FILE).is_file():
        return False
    try:
        return json.loads((path / MANIFEST_FILE).read_text()).get("format") == ARTIFACT_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def describe_reference(
    spec: str | None, manifest: dict[str, Any], progress: Progress
) -> tuple[LazyReference, ReferenceInfo]:
    """The reference's identity and a loader for the model: another artifact, a model spec, or (None) the
    exact source model the artifact was quantized from, checked by its weights hash."""
    source = manifest.get("source", {})
    if spec is not None and _is_artifact(spec):
        path = Path(spec).expanduser().resolve()
        reference_manifest = verify_artifact(path, read_manifest(path))
        info = ReferenceInfo(
            id=f"{reference_manifest.get('name', path.name)} v{reference_manifest.get('version', '')}",
            kind="artifact",
            path=str(path),
            content_sha256=content_sha256(reference_manifest),
        )
        return LazyReference(lambda: load_artifact(path, verify=False).model, progress), info
    resolved = resolve_model(spec or source.get("model_id"), progress)
    sha = weights_sha256(resolved)
    if spec is None and source.get("weights_sha256") and sha != source["weights_sha256"]:
        raise QpackError(
            f"the artifact's source model {source.get('model_id')!r} now has different weights ({sha[:12]} vs "
            f"{source['weights_sha256'][:12]}); give `reference` explicitly"
        )
    info = ReferenceInfo(id=resolved.model_id, kind=resolved.kind, weights_sha256=sha, content_sha256=sha)
    return LazyReference(lambda: load_model(resolved), progress), info
