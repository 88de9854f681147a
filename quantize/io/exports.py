"""The formats an artifact can also be written in, as settings (`QuantizeConfig(export=CompressedTensors())`); each
writer is imported when it runs, so configs stay importable without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CompressedTensors:
    """An export of the artifact as a compressed-tensors checkpoint (`QuantizeConfig(export=CompressedTensors())`)."""

    output: Path | None = None
    """Where to write it (default: ARTIFACT-compressed-tensors beside the artifact)."""

    def destination(self, artifact: Path) -> Path:
        return (
            self.output
            if self.output is not None
            else artifact.parent / f"{artifact.name}-compressed-tensors"
        )

    def write(self, artifact: Path, overwrite: bool = False) -> dict[str, Any]:
        """Export `artifact`; returns the summary recorded in the manifest."""
        from quantize.io.compressed_tensors import export_compressed_tensors

        return export_compressed_tensors(artifact, self.destination(artifact), overwrite)
