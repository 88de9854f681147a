"""The versioned artifact: safetensors + JSON, verified on load, rebuilt without the original weights.

Layout (format_version 1):
- `model.safetensors`: quantized linears as `{fqn}.{tensor}` (e.g. `qweight`, `scale`, `zero_point`), their
  biases as `{fqn}.bias`, and every other weight (embeddings, LM head, norms, FP32-kept linears) in FP32
  under its usual name. A tied LM head is stored once, as the embedding.
- `config.json`, `generation_config.json` and the tokenizer files of the source model, unchanged.
- `manifest.json`: format/version, name, version, provenance (source model id and weights hash, calibration
  manifest hash and summary), the per-module plan (scheme + algorithm), the sensitivity table, size stats,
  measured quality, the sha256 of every other file, and an `evals` section `qpack evaluate` fills in.
- `sensitivity.png`: the layer x scheme sensitivity heatmap and the chosen plan.

Only safetensors and JSON are ever read: a directory containing pickle-like files is refused, and every
listed file's hash must match before anything is loaded. Writes are atomic (temp dir, then rename).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize import __version__
from quantize.errors import QpackError
from quantize.fileio import atomic_output_dir, read_json, sha256_file, write_json
from quantize.models import tokenizer_class, tokenizer_files
from quantize.modules import QuantLinear
from quantize.plan import Plan
from quantize.schemes import Scheme
from quantize.surgery import QuantizedWeight, install
from quantize.tensorfile import read_safetensors

FORMAT = "qpack.artifact"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
HEATMAP_FILE = "sensitivity.png"
_SOURCE_FILES = ("config.json", "generation_config.json")
_FORBIDDEN_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".joblib")


def fp_state_dict(model: nn.Module, quantized: set[str]) -> dict[str, torch.Tensor]:
    """Every persistent floating-point tensor not owned by a quantized linear, tied weights stored once."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    prefixes = tuple(f"{fqn}." for fqn in quantized)
    for name, tensor in model.state_dict().items():
        if name.startswith(prefixes):
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen and tensor.numel() > 0:
            continue
        seen[key] = name
        tensors[name] = tensor.detach().to(torch.float32).contiguous()
    return tensors


def size_stats(
    fp_tensors: dict[str, torch.Tensor], records: dict[str, QuantizedWeight], plan: Plan
) -> dict[str, Any]:
    fp_bytes = sum(t.numel() * 4 for t in fp_tensors.values())
    quant_bytes = sum(r.nbytes() for r in records.values())
    quant_fp32 = sum(
        plan.shapes[f][0] * plan.shapes[f][1] * 4 + (0 if r.bias is None else r.bias.numel() * 4)
        for f, r in records.items()
    )
    total_fp32 = fp_bytes + quant_fp32
    by_kind: dict[str, int] = {}
    for _fqn, record in records.items():
        by_kind[record.scheme.label()] = by_kind.get(record.scheme.label(), 0) + record.nbytes()
    return {
        "tensor_bytes": fp_bytes + quant_bytes,
        "fp32_bytes": total_fp32,
        "ratio_to_fp32": round((fp_bytes + quant_bytes) / total_fp32, 4) if total_fp32 else 1.0,
        "fp32_kept_bytes": fp_bytes,
        "quantized_bytes": quant_bytes,
        "quantized_bytes_by_scheme": by_kind,
        "avg_bits_quantized": round(plan.bits(), 4),
    }


def _complete_config(model: nn.Module) -> dict[str, Any]:
    """The model's config as transformers read it (every default filled in, RoPE parameters in the current
    `rope_parameters` form), so that an artifact's config.json alone describes the model: the serving skeleton
    reads it without transformers' config classes."""
    config: dict[str, Any] = json.loads(model.config.to_json_string(use_diff=False))  # type: ignore[operator]
    return config


def save_artifact(
    output: Path,
    *,
    model: nn.Module,
    plan: Plan,
    records: dict[str, QuantizedWeight],
    source_dir: Path,
    manifest: dict[str, Any],
    heatmap: bytes | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the artifact directory atomically; returns the manifest as written."""
    from safetensors.torch import save_file

    quantized = set(records)
    tensors = fp_state_dict(model, quantized)
    sizes = size_stats(tensors, records, plan)
    for fqn, record in records.items():
        for name, tensor in record.tensors.items():
            tensors[f"{fqn}.{name}"] = tensor.detach().contiguous().cpu()
        if record.bias is not None:
            tensors[f"{fqn}.bias"] = record.bias.detach().to(torch.float32).contiguous().cpu()
    with atomic_output_dir(output, overwrite, "artifact directory") as tmp:
        save_file(
            tensors,
            str(tmp / WEIGHTS_FILE),
            metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)},
        )
        config = _complete_config(model)
        config.pop("quantization_config", None)
        if "lm_head" in quantized and config.get("tie_word_embeddings"):
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
            "tensors": {fqn: sorted(record.tensors) for fqn, record in records.items()},
            "tokenizer_class": tokenizer_class(source_dir),
            "size": sizes,
            "evals": manifest.get("evals", {}),
        }
        manifest["size"]["file_bytes"] = (tmp / WEIGHTS_FILE).stat().st_size
        manifest["files"] = {
            p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST_FILE
        }
        write_json(tmp / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise QpackError(
            f"artifact {root} does not exist or is not a directory; run `qpack quantize -o {root}`"
        )
    if not (root / MANIFEST_FILE).is_file():
        raise QpackError(
            f"{root} is not a qpack artifact (no {MANIFEST_FILE}); pass a directory written by qpack quantize"
        )
    manifest = read_json(root / MANIFEST_FILE, "artifact manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise QpackError(
            f"{root} is not a qpack artifact (no qpack manifest.json); pass an artifact directory"
        )
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise QpackError(
            f"artifact {root} has format_version {version}; this qpack ({__version__}) reads {FORMAT_VERSION}"
        )
    return manifest


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
    if WEIGHTS_FILE not in files:
        raise QpackError(f"artifact {root} manifest lists no {WEIGHTS_FILE}; the artifact is incomplete")
    bad = [
        name
        for name, digest in files.items()
        if not (root / name).is_file() or sha256_file(root / name) != digest
    ]
    if bad:
        raise QpackError(
            f"artifact {root} failed verification: {', '.join(bad)} missing or modified since it was written "
            "(sha256 mismatch); rebuild it with qpack quantize"
        )
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


def load_artifact(
    path: str | Path, device: str | torch.device = "cpu", verify: bool = True, skeleton: bool = False
) -> LoadedArtifact:
    """Rebuild a ready-to-run model from an artifact alone (no access to the original weights).

    skeleton=False: the Hugging Face model (forward, generate), for evaluation. skeleton=True: the same modules
    and weights in `quantize.skeleton`'s tree, without transformers' modeling code, for the serving runner
    (which has its own forward); ~130 MB less resident in a server."""
    from quantize.models import _quiet_transformers, check_architecture

    root = Path(path).expanduser().resolve()
    manifest = read_manifest(root)
    if verify:
        verify_artifact(root, manifest)
    device = torch.device(device)
    _quiet_transformers()
    config_dict = read_json(root / "config.json", "artifact config")
    check_architecture(config_dict, str(root))
    state = read_safetensors(root / WEIGHTS_FILE, "artifact weights", "rebuild the artifact")
    plan = Plan.from_json(manifest["modules"])
    model: nn.Module
    if skeleton:
        from quantize.skeleton import SkeletonConfig, build_skeleton

        config = SkeletonConfig.from_dict(config_dict, str(root / "config.json"))
        model = build_skeleton(config, list(state))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(str(root)), dtype=torch.float32
            )
    model.eval()
    for fqn, scheme in plan.quantized().items():
        names = manifest["tensors"][fqn]
        missing = [n for n in names if f"{fqn}.{n}" not in state]
        if missing:
            raise QpackError(f"artifact {root} lacks tensors {missing} of {fqn}; rebuild the artifact")
        tensors = {n: state.pop(f"{fqn}.{n}") for n in names}
        bias = state.pop(f"{fqn}.bias", None)
        record = QuantizedWeight(
            scheme=scheme, algorithm=plan.algorithms.get(fqn, "rtn"), tensors=tensors, bias=bias
        )
        install(model, fqn, record, device)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise QpackError(f"artifact {root} has unexpected tensors {result.unexpected_keys[:5]}; rebuild it")
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)  # type: ignore[operator]
    if getattr(model.config, "tie_word_embeddings", False) and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise QpackError(f"artifact {root} does not provide {', '.join(leftover[:5])}; rebuild it")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model.to(device)
    return LoadedArtifact(model=model, manifest=manifest, plan=plan, path=root)


def update_manifest(path: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Merge `updates` into the manifest (e.g. `evals`) atomically; file hashes are re-verified first."""
    root = Path(path).expanduser()
    manifest = verify_artifact(root)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    write_json(root / MANIFEST_FILE, manifest)
    return manifest


def quantized_modules(model: nn.Module) -> dict[str, Scheme]:
    return {name: m.scheme for name, m in model.named_modules() if isinstance(m, QuantLinear)}
