"""What the manifests of qpack's directories share, checked one way for all of them.

An artifact and a calibration directory each carry a `manifest.json` that names its format and version and holds
the sha256 of every other file. Reading one refuses, with one line saying what to do, a folder that is missing, a
manifest that is missing, unreadable or of another format, a version this qpack cannot read, and (verifying) any
listed file that is missing or changed since it was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.common.errors import QpackError
from quantize.common.fileio import read_json, sha256_file
from quantize.common.version import __version__

MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class ManifestFormat:
    """One kind of qpack directory, as its manifest identifies it."""

    tag: str  # the manifest's "format"
    versions: tuple[int, ...]  # the format versions this qpack reads
    what: str  # how messages name it: "artifact", "calibration directory"
    writer: str  # the command that writes one: "qpack quantize"
    rebuild: str  # how to get a good one back: "rebuild it with qpack quantize"

    def read(self, path: str | Path) -> dict[str, Any]:
        """The manifest of the directory at `path`, its format and version checked (QpackError otherwise)."""
        root = Path(path).expanduser()
        if not root.is_dir():
            raise QpackError(
                f"{self.what} {root} does not exist or is not a directory; run `{self.writer} -o {root}` first"
            )
        if not (root / MANIFEST_FILE).is_file():
            raise QpackError(
                f"{root} is not a qpack {self.what} (no {MANIFEST_FILE}); pass a directory written by {self.writer}"
            )
        manifest = read_json(root / MANIFEST_FILE, f"{self.what} manifest")
        if not isinstance(manifest, dict) or manifest.get("format") != self.tag:
            raise QpackError(
                f"{root} is not a qpack {self.what} (its {MANIFEST_FILE} is not a {self.tag} manifest); pass a "
                f"directory written by {self.writer}"
            )
        version = manifest.get("format_version")
        if version not in self.versions:
            raise QpackError(
                f"{self.what} {root} has format_version {version}; this qpack ({__version__}) reads "
                f"{', '.join(map(str, self.versions))}; upgrade qpack or {self.rebuild}"
            )
        return manifest

    def check_files(self, root: Path, files: dict[str, str]) -> None:
        """QpackError naming every listed file that is missing or whose sha256 changed since it was written."""
        changed = [
            name
            for name, digest in files.items()
            if not (root / name).is_file() or sha256_file(root / name) != digest
        ]
        if changed:
            raise QpackError(
                f"{self.what} {root} failed verification: {', '.join(changed)} missing or modified since it was "
                f"written (sha256 mismatch); {self.rebuild}"
            )
