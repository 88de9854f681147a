"""Export an artifact as a compressed-tensors checkpoint, the format transformers and vLLM load.

qpack's own artifact is the source of truth (it carries the plan, sensitivity, hashes and evals); this export
lets the same weights run on engines that scale across GPUs and nodes. Every quantized linear is re-expressed
exactly, not re-quantized: the stored integer grid is dequantized and handed to compressed-tensors' own
compressor with our scales and zero points, which recovers the same integers (tests check the round trip).

Mapping: int4 (asymmetric, per group) -> `pack-quantized` W4A16 group; int8 (symmetric, per channel) ->
`pack-quantized` W8A16 channel; w8a8 -> `int-quantized` with dynamic per-token int8 input activations;
bf16/fp16/fp32 linears stay dense and are listed in `ignore`. Not expressible, and refused with the reason:
bitsandbytes schemes (their own formats), and w8a8 layers whose SmoothQuant factor could not be folded into a
previous norm or linear (compressed-tensors has no per-input-channel activation divisor).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from quantize.common.errors import QpackError
from quantize.common.fileio import atomic_output_dir, read_json, write_json
from quantize.formats.schemes import BF16, FP16, FP32, W8A8, Int4, Int8, Scheme
from quantize.io.artifact import (
    INDEX_FILE,
    MANIFEST_FILE,
    read_manifest,
    unabsorbed_rotation,
    verify_artifact,
    weight_files,
)
from quantize.planning.plan import Plan
from quantize.runtime.handlers import handler_for


def _ct() -> Any:
    try:
        import compressed_tensors
    except ImportError:
        raise QpackError(
            "the compressed-tensors `export` needs the compressed-tensors package; install `pip install qpack[export]`"
        ) from None
    return compressed_tensors


def _scheme_args(scheme: Scheme) -> tuple[dict[str, Any], dict[str, Any] | None, str] | None:
    """(weights args, input activation args, format) or None for dense layers."""
    if isinstance(scheme, FP32 | BF16 | FP16):
        return None
    if isinstance(scheme, Int4):
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": False,
            "strategy": "group",
            "group_size": scheme.group_size,
        }
        return weights, None, "pack-quantized"
    if isinstance(scheme, Int8):
        return (
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            None,
            "pack-quantized",
        )
    if isinstance(scheme, W8A8):
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        return weights, activations, "int-quantized"
    raise ValueError(scheme.type)


def unexpressible(plan: Plan, tensor_names: dict[str, list[str]]) -> list[str]:
    problems = []
    for fqn, scheme in plan.quantized().items():
        if scheme.type.startswith("bnb-"):
            problems.append(
                f"{fqn} ({scheme.label()}): bitsandbytes formats have no compressed-tensors equivalent"
            )
        elif isinstance(scheme, W8A8) and "smooth" in tensor_names.get(fqn, []):
            problems.append(
                f"{fqn} (w8a8): its SmoothQuant factor could not be folded into a previous layer and "
                "compressed-tensors has no per-channel activation divisor"
            )
    return problems


def export_compressed_tensors(artifact: Path, output: Path, overwrite: bool = False) -> dict[str, Any]:
    """Write a compressed-tensors checkpoint of `artifact` to `output`; returns a summary for the manifest."""
    from safetensors.torch import load_file

    _ct()
    artifact = Path(artifact).expanduser().resolve()
    output = Path(output).expanduser().resolve()
    manifest = verify_artifact(artifact, read_manifest(artifact))
    rotation = unabsorbed_rotation(manifest)
    if rotation is not None:
        raise QpackError(
            f"cannot export {artifact} to compressed-tensors: {rotation}, and a compressed-tensors checkpoint holds "
            "weights only; re-quantize with a rotation absorbed into the weights (--rotate hadamard)"
        )
    plan = Plan.from_json(manifest["modules"])
    problems = unexpressible(plan, manifest.get("tensors", {}))
    if problems:
        raise QpackError(
            f"cannot export {len(problems)} layers to compressed-tensors: "
            + "; ".join(problems)
            + "; re-quantize them with int4/int8/w8a8 (qpack artifacts still serve them)"
        )
    state: dict[str, torch.Tensor] = {}
    for name in weight_files(artifact, manifest):
        state.update(load_file(str(artifact / name)))
    groups: dict[str, dict[str, Any]] = {}
    dense: list[str] = []
    out_tensors: dict[str, torch.Tensor] = {}
    for fqn, scheme in plan.quantized().items():
        tensors = {n: state.pop(f"{fqn}.{n}") for n in manifest["tensors"][fqn]}
        bias = state.pop(f"{fqn}.bias", None)
        if bias is not None:
            out_tensors[f"{fqn}.bias"] = bias
        args = _scheme_args(scheme)
        if args is None:
            out_tensors[f"{fqn}.weight"] = tensors["weight"]
            dense.append(fqn)
            continue
        weights_args, activation_args, fmt = args
        group = groups.setdefault(
            scheme.label(),
            {"weights": weights_args, "input_activations": activation_args, "format": fmt, "targets": []},
        )
        group["targets"].append(fqn)
        out_tensors.update(_compressed(fqn, scheme, tensors, weights_args, activation_args, fmt))
    out_tensors.update(state)
    ignore = [fqn for fqn, scheme in plan.schemes.items() if scheme is None] + dense
    _write_export(artifact, output, overwrite, out_tensors, _quantization_config(groups, ignore))
    return {
        "format": "compressed-tensors",
        "path": str(Path(output).resolve()),
        "groups": {key: len(group["targets"]) for key, group in groups.items()},
        "dense": dense,
        "ignore": ignore,
    }


def _compressed(
    fqn: str,
    scheme: Scheme,
    tensors: dict[str, torch.Tensor],
    weights_args: dict[str, Any],
    activation_args: dict[str, Any] | None,
    fmt: str,
) -> dict[str, torch.Tensor]:
    """One linear's tensors as its compressed-tensors compressor writes them (names prefixed with `fqn`)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weight = handler_for(scheme).dequantize(scheme, tensors)
    ct_scheme = QuantizationScheme(
        targets=[fqn],
        weights=QuantizationArgs(**weights_args),
        input_activations=None if activation_args is None else QuantizationArgs(**activation_args),
        format=fmt,
    )
    if isinstance(scheme, Int4):
        module_state = {
            "weight": weight,
            "weight_scale": tensors["scale"].to(torch.float32),
            "weight_zero_point": tensors["zero_point"].to(torch.int8) - 8,
        }
    else:
        module_state = {"weight": weight, "weight_scale": tensors["scale"].to(torch.float32)[:, None]}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    return {
        f"{fqn}.{name}": t.contiguous() for name, t in compressor.compress(module_state, ct_scheme).items()
    }


def _quantization_config(groups: dict[str, dict[str, Any]], ignore: list[str]) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    config_groups = {
        f"group_{index}": QuantizationScheme(
            targets=group["targets"],
            weights=QuantizationArgs(**group["weights"]),
            input_activations=None
            if group["input_activations"] is None
            else QuantizationArgs(**group["input_activations"]),
            format=group["format"],
        )
        for index, group in enumerate(groups.values())
    }
    formats = {group["format"] for group in groups.values()}
    return QuantizationConfig(
        config_groups=config_groups,
        format=formats.pop() if len(formats) == 1 else "mixed-precision",
        quantization_status="compressed",
        ignore=ignore,
    )


def _write_export(
    artifact: Path, output: Path, overwrite: bool, tensors: dict[str, torch.Tensor], quant_config: Any
) -> None:
    """Weights, config.json with its quantization_config, and the artifact's tokenizer files, atomically."""
    from safetensors.torch import save_file

    with atomic_output_dir(output, overwrite, "export directory") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = read_json(artifact / "config.json", "artifact config")
        config["quantization_config"] = quant_config.to_dict()
        write_json(tmp / "config.json", config)
        for path in sorted(artifact.iterdir()):
            tokenizer_file = path.suffix in (".json", ".jinja", ".model", ".txt")
            weights = path.suffix == ".safetensors" or path.name == INDEX_FILE
            if path.name not in (MANIFEST_FILE, "config.json") and not weights and tokenizer_file:
                shutil.copy2(path, tmp / path.name)
