"""The reference model's MMLU scores, computed once and reused by every later run against the same reference.

A CI pipeline evaluates many candidates against one FP32 reference; scoring the reference again each time is
half the cost of every run. The per-question scores (the four choice log-probs, per format and shot count) are
stored under the user cache, in a file named by a SHA-256 over everything that can change them: the reference
weights' content hash, the MMLU files' hash, the tokenizer files' hash, the format, the shot count and the
scoring code's version. Anything else (a different --limit, subjects or seed) only selects other questions
from the same file, so a later, larger run scores only what is missing and adds it.

The file is JSON (never pickle), written atomically, and carries its own key: a file whose key fields, JSON
or values do not check out is ignored with a warning and rewritten, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantize.common.fileio import write_bytes, write_json

LOWEST = -1e300  # JSON has no -inf: a log-prob of -inf is stored as this
SCORING_VERSION = 2  # 2: whole-string tokenization (lm-eval's); 1 tokenized prefix and question apart


@dataclass(frozen=True)
class ReferenceKey:
    reference_sha256: str
    data_sha256: str
    tokenizer_sha256: str
    fmt: str
    shots: int
    scoring_version: int = SCORING_VERSION

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def tokenizer_sha256(folder: Path) -> str:
    """SHA-256 over the tokenizer files present in FOLDER (name and content of each)."""
    from quantize.model.sources import TOKENIZER_FILES

    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def head_sha256(head: torch.nn.Module) -> str:
    """SHA-256 of an LM head's weight (FP32 in every qpack artifact: the reference's own head, bit for bit)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return ""
    data = weight.detach().to("cpu").contiguous()
    return hashlib.sha256(
        str(data.dtype).encode() + str(tuple(data.shape)).encode() + data.view(torch.uint8).numpy().tobytes()
    ).hexdigest()


@dataclass
class StoredHidden:
    hidden: list[torch.Tensor]
    head_sha256: str


class HeldoutCache:
    """The reference's final hidden states on the held-out packs ([tokens, hidden] each: 4.7 MB for SmolLM2's
    2,048 tokens, 33 MB at 8B width), in ROOT/heldout-reference/DIGEST.safetensors, keyed by the reference's
    content hash, the calibration manifest's hash, the token count, the seed and the scoring version."""

    def __init__(self, root: Path, reference_sha256: str) -> None:
        self.root = Path(root) / "heldout-reference"
        self.reference_sha256 = reference_sha256

    def _key(self, calibration_sha256: str, tokens: int, seed: int) -> dict[str, str]:
        return {
            "reference_sha256": self.reference_sha256,
            "calibration_sha256": calibration_sha256,
            "tokens": str(tokens),
            "seed": str(seed),
            "scoring_version": str(SCORING_VERSION),
        }

    def path(self, calibration_sha256: str, tokens: int, seed: int) -> Path:
        digest = hashlib.sha256(
            json.dumps(self._key(calibration_sha256, tokens, seed), sort_keys=True).encode()
        )
        return self.root / f"{digest.hexdigest()}.safetensors"

    def load(self, calibration_sha256: str, tokens: int, seed: int) -> StoredHidden | None:
        from quantize.io.tensorfile import read_safetensors

        path = self.path(calibration_sha256, tokens, seed)
        if not path.is_file():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
            tensors = read_safetensors(path, "held-out reference cache", "it will be rewritten")
            if {k: metadata.get(k) for k in self._key(calibration_sha256, tokens, seed)} != self._key(
                calibration_sha256, tokens, seed
            ):
                raise ValueError("its key does not match its name")
            hidden = [tensors[f"pack.{i}"] for i in range(len(tensors))]
            return StoredHidden(hidden, metadata.get("head_sha256", ""))
        except Exception as exc:  # any damage: recompute, never trust
            warnings.warn(f"ignoring the damaged held-out reference cache {path} ({exc})", stacklevel=2)
            return None

    def store(
        self, calibration_sha256: str, tokens: int, seed: int, hidden: list[torch.Tensor], head: str
    ) -> None:
        from safetensors.torch import save

        metadata = {**self._key(calibration_sha256, tokens, seed), "head_sha256": head}
        data = save({f"pack.{i}": h.detach().contiguous() for i, h in enumerate(hidden)}, metadata=metadata)
        self.root.mkdir(parents=True, exist_ok=True)
        write_bytes(self.path(calibration_sha256, tokens, seed), data)


class ReferenceCache:
    """{question key: 4 scores} of one reference under one `ReferenceKey`, in ROOT/mmlu-reference/DIGEST.json."""

    def __init__(self, root: Path, key: ReferenceKey) -> None:
        self.key = key
        self.path = Path(root) / "mmlu-reference" / f"{key.digest}.json"

    def load(self) -> dict[str, torch.Tensor]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("key") != asdict(self.key):
                raise ValueError("its key does not match its name")
            scores = {}
            for question, values in data["scores"].items():
                if len(values) != 4 or not all(isinstance(v, float) and not math.isnan(v) for v in values):
                    raise ValueError(f"question {question} does not have 4 scores")
                scores[str(question)] = torch.tensor(values, dtype=torch.float64)
            return scores
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            warnings.warn(
                f"ignoring the damaged reference cache {self.path} ({exc}); it will be rewritten",
                stacklevel=2,
            )
            return {}

    def store(self, scores: dict[str, torch.Tensor]) -> None:
        """Add SCORES to what is stored (atomically: a crash leaves the old file or the new one)."""
        merged = {key: value.tolist() for key, value in self.load().items()}
        merged.update(
            {
                key: [max(float(v), LOWEST) for v in value.to(torch.float64).tolist()]
                for key, value in scores.items()
            }
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"key": asdict(self.key), "scores": dict(sorted(merged.items()))})
