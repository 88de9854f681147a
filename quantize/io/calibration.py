"""The calibration directory: the data contract between `qpack calibrate` and everything after it.

`calibrate` writes it; `quantize` (activation statistics, GPTQ/AWQ inputs, sensitivity) and `evals`
(held-out perplexity and KL) read it as data. It holds token ids, never raw text (unless the user asked for
`--keep-text`), so a calibration directory built from production traffic can be shared after the PII scrub.

Layout (format_version 1):
- `manifest.json`: provenance (model, tokenizer and input hashes), cleaning counts, sampling, lengths,
  coverage, and the sha256 of every other file.
- `tokens.safetensors`: ragged token sequences, `{split}.input_ids` (int32, concatenated) and
  `{split}.offsets` (int64, len = num_sequences + 1) for the splits `train` and `heldout`.
- `stats.safetensors`: per `nn.Linear` input channel, `{fqn}.abs_max` and `{fqn}.mean_sq` (float32, [in_features])
  and `{fqn}.num_tokens` (int64, [1]).
- `sensitivity.json` (added by `qpack quantize`): cached per-layer sensitivity, keyed by model weights hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantize.common.errors import QpackError
from quantize.common.fileio import sha256_file
from quantize.io.manifest import MANIFEST_FILE, ManifestFormat

FORMAT = "qpack.calibration"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.safetensors"
STATS_FILE = "stats.safetensors"
TEXTS_FILE = "texts.jsonl"
SENSITIVITY_FILE = "sensitivity.json"
SPLITS = ("train", "heldout")
CALIBRATION = ManifestFormat(
    FORMAT, (FORMAT_VERSION,), "calibration directory", "qpack calibrate", "re-run qpack calibrate"
)


@dataclass(frozen=True)
class ChannelStats:
    """Per-input-channel statistics of one linear layer's input over the calibration tokens."""

    abs_max: torch.Tensor  # [in_features] float32
    mean_sq: torch.Tensor  # [in_features] float32
    num_tokens: int


def pack_sequences(sequences: list[list[int]], split: str) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = [token for sequence in sequences for token in sequence]
    return {
        f"{split}.input_ids": torch.tensor(flat, dtype=torch.int32),
        f"{split}.offsets": offsets,
    }


def unpack_sequences(tensors: dict[str, torch.Tensor], split: str) -> list[torch.Tensor]:
    ids = tensors[f"{split}.input_ids"].to(torch.int64)
    offsets = tensors[f"{split}.offsets"].tolist()
    return [ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def stats_to_tensors(stats: dict[str, ChannelStats]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for fqn, stat in stats.items():
        tensors[f"{fqn}.abs_max"] = stat.abs_max.to(torch.float32).contiguous()
        tensors[f"{fqn}.mean_sq"] = stat.mean_sq.to(torch.float32).contiguous()
        tensors[f"{fqn}.num_tokens"] = torch.tensor([stat.num_tokens], dtype=torch.int64)
    return tensors


def stats_from_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, ChannelStats]:
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    return {
        fqn: ChannelStats(
            abs_max=tensors[f"{fqn}.abs_max"],
            mean_sq=tensors[f"{fqn}.mean_sq"],
            num_tokens=int(tensors[f"{fqn}.num_tokens"].item()),
        )
        for fqn in names
    }


@dataclass
class CalibrationData:
    path: Path
    manifest: dict[str, Any]
    train: list[torch.Tensor]
    heldout: list[torch.Tensor]
    stats: dict[str, ChannelStats]

    @property
    def weights_sha256(self) -> str:
        return str(self.manifest.get("model", {}).get("weights_sha256", ""))

    @property
    def manifest_sha256(self) -> str:
        return sha256_file(self.path / MANIFEST_FILE)

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> CalibrationData:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        root = Path(path).expanduser()
        manifest = CALIBRATION.read(root)
        if verify:
            CALIBRATION.check_files(root, manifest.get("files", {}))
        try:
            tokens = load_file(str(root / TOKENS_FILE))
            stats = load_file(str(root / STATS_FILE))
        except (OSError, SafetensorError) as exc:
            raise QpackError(
                f"calibration directory {root} is unreadable ({exc}); re-run qpack calibrate"
            ) from None
        return cls(
            path=root,
            manifest=manifest,
            train=unpack_sequences(tokens, "train"),
            heldout=unpack_sequences(tokens, "heldout"),
            stats=stats_from_tensors(stats),
        )
