"""`qpack quantize`: calibration directory + model in, verified mixed-precision artifact out.

Order of work: validate every option (all problems reported at once), check the calibration was built for
this exact model (weights hash), resolve the plan rules, measure sensitivity of the layers the planner is
free to choose for (cached), solve the plan under the budget and show it *before* touching the model, then
quantize block by block (scale folding, GPTQ/RTN), measure the result against FP32 on held-out tokens, and
write the artifact atomically."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.common.errors import QpackError
from quantize.common.fileio import check_output_dir
from quantize.common.memory import peak_rss_mb
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.config import HeldoutQuality, QuantizeConfig, QuantizeResult
from quantize.distill.run import CURVE_FILE, Distilled, distill_held
from quantize.formats.schemes import Int4, Int8
from quantize.io.artifact import (
    DEFAULT_SHARD_BYTES,
    ArtifactWriter,
    _complete_config,
    artifact_writer,
    finish_artifact,
)
from quantize.io.calibration import CalibrationData, ChannelStats
from quantize.model.sources import ModelSource, load_model, resolve_model, weights_sha256
from quantize.model.surgery import kept_module_names
from quantize.planning.build import build_plan
from quantize.planning.plan import Plan
from quantize.quality import compare_hidden, eval_packs
from quantize.rotation.absorb import Rotation, rotate_model, rotation_for
from quantize.runtime.kernels import ops as kernels
from quantize.sensitivity.table import SensitivityTable
from quantize.sequential.apply import apply_plan
from quantize.sequential.packing import sample_sequences
from quantize.sequential.runner import BlockRunner
from quantize.sequential.streamed import StreamedModel, check_memory


def _check_calibration_matches(source: ModelSource, calibration: CalibrationData, weights_sha: str) -> None:
    expected = calibration.weights_sha256
    if expected and expected != weights_sha:
        raise QpackError(
            f"calibration {calibration.path} was built for model {calibration.manifest['model'].get('id')!r} "
            f"(weights {expected[:12]}), not {source.model_id!r} (weights {weights_sha[:12]}); "
            "re-run qpack calibrate for this model"
        )


@dataclass
class _Inputs:
    """Everything a quantize run reads, checked: options, output path, calibration, the model (streamed: its
    decoder blocks are read from the checkpoint one at a time)."""

    output: Path
    calibration: CalibrationData
    source: ModelSource
    weights_sha: str
    streamed: StreamedModel
    rotation: Rotation | None = None

    @property
    def model(self) -> nn.Module:
        return self.streamed.model

    @property
    def weights_identity(self) -> str:
        """What the weights every pass sees depend on: the checkpoint, and the rotation (sensitivity is cached
        under it, so a rotated run never reuses an unrotated run's measurements)."""
        if self.rotation is None:
            return self.weights_sha
        spec = json.dumps(self.rotation.to_json(), sort_keys=True)
        return hashlib.sha256(f"{self.weights_sha}|rotation={spec}".encode()).hexdigest()

    def load_whole(self) -> nn.Module:
        """The model in memory (for the passes that need it whole), rotated as the streamed one is."""
        model = load_model(self.source)
        if self.rotation is not None:
            rotate_model(model, self.rotation)
        return model

    def channel_stats(self) -> dict[str, ChannelStats]:
        """The calibration's activation statistics, in the basis the weights are in: none with a rotation (AWQ and
        SmoothQuant then take them from the rotated inputs' Hessians in the pass)."""
        return {} if self.rotation is not None else self.calibration.stats


def _load_inputs(config: QuantizeConfig, progress: Progress, timings: dict[str, float]) -> _Inputs:
    config.validate()
    output = Path(config.output).expanduser().resolve()
    check_output_dir(output, config.overwrite, "artifact directory")
    calibration = CalibrationData.load(config.calibration)
    source = resolve_model(config.model or calibration.manifest["model"].get("id"), progress)
    weights_sha = weights_sha256(source)
    _check_calibration_matches(source, calibration, weights_sha)
    torch.manual_seed(config.seed)
    phase = time.perf_counter()
    rotation = _rotation(config, source)
    streamed = StreamedModel(source.path, rotation=rotation)
    check_memory(streamed, config.calib_tokens + 2 * config.eval_tokens, config.max_memory)
    timings["load"] = time.perf_counter() - phase
    return _Inputs(output, calibration, source, weights_sha, streamed, rotation)


def _rotation(config: QuantizeConfig, source: ModelSource) -> Rotation | None:
    """The rotation `--rotate` asks for, or a clear refusal for a model it cannot be absorbed into."""
    if config.rotate == "none":
        return None
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(str(source.path))
    try:
        seed = config.seed if config.rotate_seed is None else config.rotate_seed
        return rotation_for(model_config, config.rotate, seed)
    except ValueError as exc:
        raise QpackError(
            f"--rotate {config.rotate} cannot be applied to {source.model_id}: {exc}; quantize it without --rotate"
        ) from None


def _quantize_and_measure(
    inputs: _Inputs,
    plan: Plan,
    config: QuantizeConfig,
    writer: ArtifactWriter,
    progress: Progress,
    timings: dict[str, float],
) -> tuple[dict[str, dict[str, Any]], HeldoutQuality, HeldoutQuality | None, Distilled | None]:
    """One pass over the blocks: quantize and write each, carrying held-out tokens through the FP32 and the
    quantized block; then KL, top-1 and perplexities of the two, and of the int8 prompt path (`--prefill-dtype
    int8`) where the plan has int8/int4 linears. With `distill`: the pass holds its tensors and keeps the FP32
    teacher's, the scales are trained, and the held-out quality is measured again."""
    phase = time.perf_counter()
    packs = eval_packs(inputs.calibration, config.eval_tokens, config.seed)
    runner = BlockRunner(inputs.streamed)
    calibration = sample_sequences(inputs.calibration.train, config.calib_tokens, config.seed)
    if config.distill is not None:
        writer.hold()
    result = apply_plan(
        runner,
        plan,
        inputs.channel_stats(),
        calibration,
        writer,
        packs,
        progress,
        teacher=config.distill is not None,
        int8_prompts=any(isinstance(s, Int8 | Int4) for s in plan.quantized().values()),
    )
    timings["quantize"] = time.perf_counter() - phase
    phase = time.perf_counter()
    with progress.task("Measuring the artifact against FP32 on held-out tokens"):
        quality = compare_hidden(
            packs, result.reference, result.candidate, result.reference_head, result.candidate_head
        )
        prompt_int8 = None
        if result.candidate_int8 is not None:
            prompt_int8 = compare_hidden(
                packs, result.reference, result.candidate_int8, result.reference_head, result.candidate_head
            )
    timings["evaluate"] = time.perf_counter() - phase
    distilled = None
    if config.distill is not None:
        phase = time.perf_counter()
        distilled = distill_held(
            runner, plan, writer, result, packs, quality, config.distill, config.max_memory, progress
        )
        quality, prompt_int8 = distilled.quality, distilled.prompt_int8
        writer.release()
        timings["distill"] = time.perf_counter() - phase
    runner.forget_rope()
    return result.info, quality, prompt_int8, distilled


def _manifest(
    config: QuantizeConfig,
    inputs: _Inputs,
    info: dict[str, Any],
    module_info: dict[str, dict[str, Any]],
    table: SensitivityTable | None,
    quality: HeldoutQuality,
    prompt_int8: HeldoutQuality | None,
    timings: dict[str, float],
    warnings: list[str],
) -> dict[str, Any]:
    """The manifest's provenance, plan and quality sections (the artifact writer adds files, sizes, hashes)."""
    source, calibration = inputs.source, inputs.calibration
    return {
        "name": config.name or f"{source.model_id.rsplit('/', 1)[-1]}-{config.preset.name}",
        "version": config.version,
        "source": {
            "model_id": source.model_id,
            "kind": source.kind,
            "model_type": source.model_type,
            "architecture": source.architecture,
            "weights_sha256": inputs.weights_sha,
        },
        "calibration": {
            "path": str(calibration.path),
            "manifest_sha256": calibration.manifest_sha256,
            "train_sequences": len(calibration.train),
            "heldout_sequences": len(calibration.heldout),
            "cleaning": calibration.manifest.get("cleaning", {}),
            "inputs": [
                {"path": i.get("path"), "sha256": i.get("sha256")}
                for i in calibration.manifest.get("inputs", [])
            ],
        },
        "quantization": {
            "preset": config.preset.name,
            "plan_info": {k: v for k, v in info.items() if k != "summary"},
            "summary": info["summary"],
            "overrides": config.rules().to_json(),
            "algorithm": config.algorithm.to_json(),
            "calib_tokens": config.calib_tokens,
            "rotation": _rotation_json(inputs),
            "module_info": module_info,
            "warnings": warnings,
        },
        "sensitivity": None
        if table is None
        else {"method": table.method, "tokens": table.num_tokens, "rows": table.rows()},
        "quality": {
            **quality.to_json(),
            "predicted_kl": info.get("predicted_kl"),
            "numerics": {"prefill_dtype": "float32", "native_kernels": kernels.isa()},
            # the same held-out tokens with prompts on int8 activations (`--prefill-dtype int8`); None: no
            # int8/int4 linears
            "prompt_int8": None if prompt_int8 is None else prompt_int8.to_json(),
        },
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "memory": {
            "peak_blocks_materialized": inputs.streamed.peak_blocks,
            "block_loads": inputs.streamed.loads,
            "peak_rss_mb": round(peak_rss_mb(), 1),
        },
        "evals": {},
    }


def _rotation_json(inputs: _Inputs) -> dict[str, Any] | None:
    """The manifest's record of the rotation: kind, seed, the Hadamard sizes, and a head untied by it."""
    if inputs.rotation is None:
        return None
    record = inputs.rotation.to_json()
    if inputs.streamed.source_tied:
        config: Any = inputs.model.config
        record["untied_head"] = True
        record["untied_head_bytes"] = int(config.vocab_size) * int(config.hidden_size) * 4
    return record


def quantize_model(
    config: QuantizeConfig,
    progress: Progress = NULL_PROGRESS,
    on_plan: Callable[[Plan, dict[str, Any]], None] | None = None,
) -> QuantizeResult:
    """Load and check the inputs, plan (shown through `on_plan` before any weight changes), quantize and
    measure, write the artifact atomically, export if asked."""
    from quantize.planning.heatmap import heatmap_png

    started = time.perf_counter()
    timings: dict[str, float] = {}
    warnings: list[str] = []
    inputs = _load_inputs(config, progress, timings)
    kernels.enable()  # the quality measured is that of the artifact as served (built once per machine)
    phase = time.perf_counter()
    plan, table, candidates, info = build_plan(
        config,
        inputs.model,
        inputs.calibration,
        inputs.weights_identity,
        progress,
        warnings,
        inputs.load_whole,
        inputs.streamed,
    )
    timings["plan"] = time.perf_counter() - phase
    info["summary"] = plan.summary(kept_module_names(inputs.model))
    if on_plan is not None:
        on_plan(plan, info)
    with artifact_writer(
        inputs.output, config.overwrite, config.max_shard_size or DEFAULT_SHARD_BYTES
    ) as writer:
        module_info, quality, prompt_int8, distilled = _quantize_and_measure(
            inputs, plan, config, writer, progress, timings
        )
        manifest_data = _manifest(
            config, inputs, info, module_info, table, quality, prompt_int8, timings, warnings
        )
        if distilled is not None and config.distill is not None:
            manifest_data["quantization"]["distill"] = distilled.to_json(config.distill)
            (writer.folder / CURVE_FILE).write_bytes(distilled.png)
        heatmap = heatmap_png(plan, table, candidates) if table is not None else heatmap_png(plan, None, [])
        phase = time.perf_counter()
        manifest = finish_artifact(
            writer,
            config=_complete_config(inputs.model),
            plan=plan,
            source_dir=inputs.source.path,
            manifest=manifest_data,
            heatmap=heatmap,
        )
    timings["save"] = time.perf_counter() - phase
    if config.export is not None:
        manifest["export"] = config.export.write(inputs.output, config.overwrite)
    return QuantizeResult(inputs.output, manifest, plan, quality, time.perf_counter() - started, warnings)
