"""The versioned artifact: safetensors + JSON, verified on load, rebuilt without the original weights.

Layout (format_version 2; version 1, a single `model.safetensors`, still loads):
- Weights: quantized linears as `{fqn}.{tensor}` (e.g. `qweight`, `scale`, `zero_point`), their biases as
  `{fqn}.bias`, and every other weight (embeddings, LM head, norms, FP32-kept linears) in FP32 under its usual
  name; a tied LM head is stored once, as the embedding. One `model.safetensors` when the weights fit one shard
  of `--max-shard-size` (default 2 GB), else `model-0000k-of-0000n.safetensors` with the Hugging Face index
  `model.safetensors.index.json`. A module's tensors never straddle two shards. The quantizer writes shards as
  blocks are quantized, and the loader reads them one at a time, so neither holds the whole artifact twice.
- `config.json`, `generation_config.json` and the tokenizer files of the source model, unchanged.
- `manifest.json`: format/version, name, version, provenance (source model id and weights hash, calibration
  manifest hash and summary), the per-module plan (scheme + algorithm), the sensitivity table, size stats,
  measured quality, the sha256 of every other file, and an `evals` section `qpack evaluate` fills in.
- `sensitivity.png`: the layer x scheme sensitivity heatmap and the chosen plan.
- `evals/<run>/`: the reports of the latest `qpack evaluate`, listed and hashed in the manifest like every file
  (the manifest's `evals.mmlu.report_dir` names the folder). `.manifest.lock`: the lock `update_manifest` takes.

Only safetensors and JSON are ever read: a directory containing pickle-like files is refused, and every
listed file's hash must match before anything is loaded. Writes are atomic (temp dir, then rename).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from quantize.common.errors import QpackError
from quantize.common.fileio import atomic_output_dir, read_json, sha256_file, write_json
from quantize.common.version import __version__
from quantize.io.manifest import MANIFEST_FILE, ManifestFormat
from quantize.io.tensorfile import read_safetensors
from quantize.model.sources import tokenizer_class, tokenizer_files
from quantize.model.surgery import QuantizedWeight, install
from quantize.planning.plan import Plan
from quantize.rotation import unabsorbed

FORMAT = "qpack.artifact"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 10**9
LOCK_FILE = ".manifest.lock"
HEATMAP_FILE = "sensitivity.png"
_SOURCE_FILES = ("config.json", "generation_config.json")
_FORBIDDEN_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".joblib")


class ArtifactWriter:
    """An artifact's weights written shard by shard as a quantize pass produces them, and its size stats.

    `add_fp` and `add_quantized` take one module's (or block's) tensors at a time; a shard is written once the
    next group would overflow `max_shard_bytes`, so at most one shard's tensors are held. `finish` names the
    shards (`model.safetensors` alone, or `model-0000k-of-0000n` with an index) and returns their names."""

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.folder, self.max_shard_bytes = folder, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.fp_bytes = self.quantized_bytes = self.quantized_fp32_bytes = 0
        self.by_scheme: dict[str, int] = {}
        self.tensor_names: dict[str, list[str]] = {}
        self.holding = False
        self.held_groups: list[list[str]] = []  # while holding: the names of each group added, in order

    def add_fp(self, tensors: dict[str, torch.Tensor]) -> None:
        """Weights kept in floating point, stored as FP32 (embeddings, head, norms, FP32-kept linears)."""
        fp32 = {name: t.detach().to(torch.float32).contiguous().cpu() for name, t in tensors.items()}
        self.fp_bytes += sum(t.numel() * 4 for t in fp32.values())
        self._add(fp32)

    def add_quantized(self, fqn: str, record: QuantizedWeight, shape: tuple[int, int]) -> None:
        tensors = {f"{fqn}.{name}": t.detach().contiguous().cpu() for name, t in record.tensors.items()}
        if record.bias is not None:
            tensors[f"{fqn}.bias"] = record.bias.detach().to(torch.float32).contiguous().cpu()
        nbytes = record.nbytes()
        self.quantized_bytes += nbytes
        self.quantized_fp32_bytes += shape[0] * shape[1] * 4 + (
            0 if record.bias is None else record.bias.numel() * 4
        )
        label = record.scheme.label()
        self.by_scheme[label] = self.by_scheme.get(label, 0) + nbytes
        self.tensor_names[fqn] = sorted(record.tensors)
        self._add(tensors)

    def hold(self) -> None:
        """Keep every tensor added from now on in memory (no shard written) until `release`: a step after the
        pass (distillation) may still change them."""
        self.holding = True

    def release(self) -> None:
        """Write what was held, in the order it came and in the groups it came in (a module's tensors still never
        straddle two shards), sharded as usual."""
        self.holding = False
        held, groups = self.pending, self.held_groups
        self.pending, self.pending_bytes, self.held_groups = {}, 0, []
        for names in groups:
            self._add({name: held[name] for name in names})

    def _add(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.holding:
            self.held_groups.append(list(tensors))
        elif self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending.update(tensors)
        self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        self.shards.append((path, sorted(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        if self.holding:
            self.release()
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.shards[0][0], self.folder / WEIGHTS_FILE)
            return [WEIGHTS_FILE]
        names, weight_map = [], {}
        for number, (path, tensors) in enumerate(self.shards, start=1):
            name = f"model-{number:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(path, self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(tensors, name))
        total = sum((self.folder / n).stat().st_size for n in names)
        write_json(self.folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        return names

    def size_stats(self, plan: Plan) -> dict[str, Any]:
        total_fp32 = self.fp_bytes + self.quantized_fp32_bytes
        stored = self.fp_bytes + self.quantized_bytes
        return {
            "tensor_bytes": stored,
            "fp32_bytes": total_fp32,
            "ratio_to_fp32": round(stored / total_fp32, 4) if total_fp32 else 1.0,
            "fp32_kept_bytes": self.fp_bytes,
            "quantized_bytes": self.quantized_bytes,
            "quantized_bytes_by_scheme": dict(self.by_scheme),
            "avg_bits_quantized": round(plan.bits(), 4),
        }


def _complete_config(model: nn.Module) -> dict[str, Any]:
    """The model's config as transformers read it (every default filled in, RoPE parameters in the current
    `rope_parameters` form), so that an artifact's config.json alone describes the model: the serving skeleton
    reads it without transformers' config classes."""
    config: dict[str, Any] = json.loads(cast(Any, model).config.to_json_string(use_diff=False))
    return config


@contextmanager
def artifact_writer(
    output: Path, overwrite: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Iterator[ArtifactWriter]:
    """An `ArtifactWriter` over a partial directory that `finish_artifact` completes and the exit renames into
    place (removed on any error)."""
    with atomic_output_dir(output, overwrite, "artifact directory") as tmp:
        yield ArtifactWriter(tmp, max_shard_bytes)


def finish_artifact(
    writer: ArtifactWriter,
    *,
    config: dict[str, Any],
    plan: Plan,
    source_dir: Path,
    manifest: dict[str, Any],
    heatmap: bytes | None = None,
) -> dict[str, Any]:
    """Shards named, config, tokenizer and heatmap copied, the manifest (sizes, every file's sha256) written."""
    tmp = writer.folder
    weights = writer.finish()
    config = dict(config)
    config.pop("quantization_config", None)
    if plan.schemes.get("lm_head") is not None and config.get("tie_word_embeddings"):
        config["tie_word_embeddings"] = False
    write_json(tmp / "config.json", config)
    if (source_dir / "generation_config.json").is_file():
        shutil.copy2(source_dir / "generation_config.json", tmp / "generation_config.json")
    for path in tokenizer_files(source_dir):
        shutil.copy2(path, tmp / path.name)
    if heatmap is not None:
        (tmp / HEATMAP_FILE).write_bytes(heatmap)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **manifest,
        "qpack_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "modules": plan.to_json(),
        "tensors": dict(writer.tensor_names),
        "tokenizer_class": tokenizer_class(source_dir),
        "size": writer.size_stats(plan),
        "weights": weights,
        "evals": manifest.get("evals", {}),
    }
    manifest["size"]["file_bytes"] = sum((tmp / name).stat().st_size for name in weights)
    manifest["files"] = {
        p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST_FILE
    }
    write_json(tmp / MANIFEST_FILE, manifest)
    return manifest


def content_sha256(manifest: dict[str, Any]) -> str:
    """SHA-256 over the hashes of what the model computes with (weights, config, tokenizer: every file but the
    eval reports), so evaluating an artifact, which adds reports, does not change its identity."""
    files = {
        name: digest for name, digest in manifest.get("files", {}).items() if not name.startswith("evals/")
    }
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def weight_files(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The artifact's weight files: the manifest's list (format 2), or the single file of format 1."""
    return list(manifest.get("weights") or [WEIGHTS_FILE])


ARTIFACT = ManifestFormat(
    FORMAT, READABLE_VERSIONS, "artifact", "qpack quantize", "rebuild it with qpack quantize"
)


def read_manifest(path: Path) -> dict[str, Any]:
    return ARTIFACT.read(path)


def verify_artifact(path: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check format, forbidden files and every hash; returns the manifest."""
    root = Path(path).expanduser()
    manifest = manifest or read_manifest(root)
    forbidden = sorted(p.name for p in root.iterdir() if p.suffix.lower() in _FORBIDDEN_SUFFIXES)
    if forbidden:
        raise QpackError(
            f"artifact {root} contains {', '.join(forbidden)}: only safetensors and JSON are loaded, never pickles; "
            "remove them"
        )
    files = manifest.get("files") or {}
    unlisted = [name for name in weight_files(root, manifest) if name not in files]
    if unlisted:
        raise QpackError(
            f"artifact {root} manifest has no hash for {', '.join(unlisted)}; the artifact is incomplete"
        )
    ARTIFACT.check_files(root, files)
    return manifest


@dataclass
class LoadedArtifact:
    model: nn.Module
    manifest: dict[str, Any]
    plan: Plan
    path: Path

    @property
    def name(self) -> str:
        return str(self.manifest.get("name", self.path.name))

    @property
    def version(self) -> str:
        return str(self.manifest.get("version", ""))


def unabsorbed_rotation(manifest: dict[str, Any]) -> str | None:
    """Why the artifact's recorded rotation is not all in its weights (None: it is, or there is none): what
    loading and every export refuse rather than run or write another model."""
    return unabsorbed(manifest.get("quantization", {}).get("rotation"))


def load_artifact(
    path: str | Path, device: str | torch.device = "cpu", verify: bool = True, skeleton: bool = False
) -> LoadedArtifact:
    """Rebuild a ready-to-run model from an artifact alone (no access to the original weights).

    skeleton=False: the Hugging Face model (forward, generate), for evaluation. skeleton=True: the same modules
    and weights in `quantize.runtime.skeleton`'s tree, without transformers' modeling code, for the serving runner
    (which has its own forward); ~130 MB less resident in a server."""
    from quantize.model.sources import check_architecture, quiet_transformers

    root = Path(path).expanduser().resolve()
    manifest = read_manifest(root)
    if verify:
        verify_artifact(root, manifest)
    rotation = unabsorbed_rotation(manifest)
    if rotation is not None:
        raise QpackError(
            f"cannot load artifact {root}: {rotation}; load it with the qpack version that wrote it "
            f"({manifest.get('qpack_version', 'unknown')}) or re-quantize it"
        )
    device = torch.device(device)
    quiet_transformers()
    config_dict = read_json(root / "config.json", "artifact config")
    check_architecture(config_dict, str(root))
    files = weight_files(root, manifest)
    plan = Plan.from_json(manifest["modules"])
    model = _empty_model(root, config_dict, files, skeleton)
    model.eval()
    pending: dict[str, torch.Tensor] = {}
    for name in files:  # one shard in memory at a time, each tensor handed to its module as it is read
        pending.update(read_safetensors(root / name, "artifact weights", "rebuild the artifact"))
        _install_ready(model, plan, manifest, pending, device)
        result = model.load_state_dict(
            {k: v for k, v in pending.items() if not _quantized_owner(k, plan)}, strict=False, assign=True
        )
        if result.unexpected_keys:
            raise QpackError(
                f"artifact {root} has unexpected tensors {result.unexpected_keys[:5]}; rebuild it"
            )
        pending = {k: v for k, v in pending.items() if _quantized_owner(k, plan)}
    if pending:
        owners = sorted({_quantized_owner(k, plan) or k for k in pending})
        raise QpackError(f"artifact {root} lacks tensors of {', '.join(owners[:3])}; rebuild the artifact")
    tree: Any = model  # a Llama-family tree: its modules by name
    tree.model.rotary_emb = type(tree.model.rotary_emb)(config=tree.config).to(device)
    if getattr(tree.config, "tie_word_embeddings", False) and isinstance(tree.lm_head, nn.Linear):
        tree.lm_head.weight = tree.model.embed_tokens.weight
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise QpackError(f"artifact {root} does not provide {', '.join(leftover[:5])}; rebuild it")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model.to(device)
    return LoadedArtifact(model=model, manifest=manifest, plan=plan, path=root)


def _empty_model(root: Path, config_dict: dict[str, Any], files: list[str], skeleton: bool) -> nn.Module:
    """The module tree on `meta`: the serving skeleton, or the Hugging Face model."""
    if skeleton:
        from quantize.io.tensorfile import index_safetensors
        from quantize.runtime.skeleton import SkeletonConfig, build_skeleton

        config = SkeletonConfig.from_dict(config_dict, str(root / "config.json"))
        names = [
            n
            for f in files
            for n in index_safetensors(root / f, "artifact weights", "rebuild the artifact")[0]
        ]
        return build_skeleton(config, names)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(root)), dtype=torch.float32)


def _quantized_owner(name: str, plan: Plan) -> str | None:
    """The quantized linear a stored tensor belongs to (`{fqn}.qweight`, `{fqn}.bias`...), if any."""
    fqn = name.rpartition(".")[0]
    return fqn if plan.schemes.get(fqn) is not None else None


def _install_ready(
    model: nn.Module,
    plan: Plan,
    manifest: dict[str, Any],
    pending: dict[str, torch.Tensor],
    device: torch.device,
) -> None:
    """Install every quantized linear whose tensors have all been read (popping them from `pending`)."""
    for fqn, scheme in plan.quantized().items():
        names = manifest["tensors"][fqn]
        if not all(f"{fqn}.{n}" in pending for n in names):
            continue
        tensors = {n: pending.pop(f"{fqn}.{n}") for n in names}
        bias = pending.pop(f"{fqn}.bias", None)
        record = QuantizedWeight(
            scheme=scheme,
            algorithm=plan.algorithms[fqn].name if fqn in plan.algorithms else "rtn",
            tensors=tensors,
            bias=bias,
        )
        install(model, fqn, record, device)


@dataclass
class ManifestUpdate:
    """An artifact's manifest as read under its lock; `commit` replaces it (temp file + rename: all or nothing)."""

    root: Path
    manifest: dict[str, Any]

    def commit(self, manifest: dict[str, Any]) -> None:
        write_json(self.root / MANIFEST_FILE, manifest)
        self.manifest = manifest


@contextmanager
def update_manifest(path: Path) -> Iterator[ManifestUpdate]:
    """The one way to change a written artifact's manifest: read it under the artifact's exclusive lock (flock on
    ROOT/.manifest.lock, held for the whole block), commit the new one. Concurrent updates (two `qpack evaluate`
    runs) are thereby serialized, so none is lost, and files the block writes or removes beside the manifest are
    never seen half-done by another update."""
    root = Path(path).expanduser()
    read_manifest(root)
    try:
        lock = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        raise QpackError(
            f"cannot lock artifact {root} for writing ({error.strerror}); check its permissions"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield ManifestUpdate(root, read_manifest(root))
    finally:
        os.close(lock)
