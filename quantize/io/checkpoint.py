"""A safetensors checkpoint read tensor by tensor: one file, or shards listed by `model.safetensors.index.json`.

A 7B-class model is 15 GB in bf16 and 30 GB in FP32: more than a CI runner holds. Nothing here loads a whole
file: the headers of every shard are validated once (`tensorfile`), and each tensor is read on demand into its
own aligned allocation, in its stored dtype or cast as asked, so a caller can hold one decoder block at a time.
Every problem (a shard the index names but the folder lacks, a tensor in two shards, a broken header) is
reported in one error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize.common.errors import QpackError
from quantize.io.tensorfile import Entry, index_safetensors, read_entry

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorRef:
    path: Path
    start: int  # where the file's data section begins
    entry: Entry  # dtype, shape, begin, end (relative to the data section)

    @property
    def dtype(self) -> torch.dtype:
        return self.entry[0]

    @property
    def shape(self) -> list[int]:
        return self.entry[1]

    @property
    def nbytes(self) -> int:
        return self.entry[3] - self.entry[2]


class Checkpoint:
    """The tensors of a folder's safetensors files, by name; read one at a time."""

    def __init__(self, folder: Path, what: str = "weights file", fix: str = "re-download the model") -> None:
        self.folder = Path(folder)
        self.what, self.fix = what, fix
        self.refs: dict[str, TensorRef] = {}
        problems: list[str] = []
        for path in self._files(problems):
            entries, start = index_safetensors(path, what, fix)
            for name, entry in entries.items():
                if name in self.refs:
                    problems.append(f"{name} is in both {self.refs[name].path.name} and {path.name}")
                self.refs[name] = TensorRef(path, start, entry)
        if problems:
            raise QpackError(f"checkpoint {self.folder} is inconsistent: {'; '.join(problems[:5])}; {fix}")

    def _files(self, problems: list[str]) -> list[Path]:
        index = self.folder / INDEX_FILE
        if not index.is_file():
            return sorted(self.folder.glob("*.safetensors"))
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise QpackError(f"{index} is not a safetensors index ({exc}); {self.fix}") from None
        missing = [n for n in names if not (self.folder / n).is_file()]
        problems.extend(f"the index names {n}, which is missing" for n in missing)
        return [self.folder / n for n in names if n not in missing]

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.refs if n.startswith(prefix))

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        return sum(self.refs[n].nbytes for n in (self.refs if names is None else names))

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, in its stored dtype or cast to `dtype` (a 16-bit weight upcast only when asked)."""
        ref = self.refs[name]
        try:
            with open(ref.path, "rb") as handle:
                tensor = read_entry(handle, ref.start, name, ref.entry)
        except (OSError, ValueError) as exc:
            raise QpackError(f"{self.what} {ref.path} is unreadable at {name} ({exc}); {self.fix}") from None
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
