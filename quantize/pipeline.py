"""`qpack quantize`: calibration directory + model in, verified mixed-precision artifact out.

Order of work: validate every option (all problems reported at once), check the calibration was built for
this exact model (weights hash), resolve the plan rules, measure sensitivity of the layers the planner is
free to choose for (cached), solve the plan under the budget and show it *before* touching the model, then
quantize block by block (scale folding, GPTQ/RTN), measure the result against FP32 on held-out tokens, and
write the artifact atomically.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize import algorithms as A
from quantize.artifact import (
    DEFAULT_SHARD_BYTES,
    ArtifactWriter,
    _complete_config,
    artifact_writer,
    finish_artifact,
)
from quantize.blockwise import quantize_blockwise
from quantize.calibdata import CalibrationData
from quantize.errors import QpackError
from quantize.fileio import check_output_dir
from quantize.kernels import ops as kernels
from quantize.layerwise import LayerwiseModel
from quantize.memory import available_memory
from quantize.models import ModelSource, load_model, resolve_model, weights_sha256
from quantize.plan import EMBEDDING_NAMES, Plan, PlanRules, is_decoder_linear
from quantize.planner import Option, solve
from quantize.progress import NULL_PROGRESS, Progress
from quantize.quality import compare_hidden, eval_packs
from quantize.schemes import Int4, Int8, Scheme, parse_scheme
from quantize.sensitivity import METHODS, SensitivityConfig, SensitivityTable, measure_sensitivity
from quantize.streamed import StreamedModel, check_memory
from quantize.surgery import kept_module_names, linear_shapes


@dataclass(frozen=True)
class Preset:
    candidates: tuple[str, ...]
    target_bits: float | None
    description: str


PRESETS: dict[str, Preset] = {
    "int8": Preset(
        ("int8", "bf16"), 8.5, "int8 everywhere, the most sensitive layers kept in bf16 (8.5 bits)"
    ),
    "int4": Preset(
        ("int4",), None, "int4 everywhere at --group-size (int8 where the group size does not fit)"
    ),
    "mixed": Preset(
        ("int4-g128", "int4-g64", "int8", "bf16"),
        4.75,
        "int4/int8/bf16 per layer from sensitivity (4.75 bits)",
    ),
    "w8a8": Preset(("w8a8",), None, "int8 weights and per-token int8 activations (SmoothQuant)"),
}
DEFAULT_ALGORITHMS: dict[str, str] = {"int8": "gptq", "int4": "gptq", "w8a8": "smoothquant"}


@dataclass(frozen=True)
class QuantizeConfig:
    output: Path
    calibration: Path
    model: str | None = None
    name: str | None = None
    version: str = "1"
    preset: str = "mixed"
    target_bits: float | None = None
    max_kl: float | None = None
    schemes: tuple[str, ...] = ()
    group_size: int = 64
    overrides: tuple[str, ...] = ()
    algorithm: str = "auto"
    gptq: A.GPTQConfig = dataclasses.field(default_factory=A.GPTQConfig)
    awq: A.AWQConfig = dataclasses.field(default_factory=A.AWQConfig)
    smoothquant_alpha: float = 0.5
    sensitivity: SensitivityConfig = dataclasses.field(default_factory=SensitivityConfig)
    calib_tokens: int = 4096
    eval_tokens: int = 2048
    export: str | None = None
    overwrite: bool = False
    seed: int = 0
    max_shard_size: int = DEFAULT_SHARD_BYTES
    max_memory: int | None = None  # bytes; None: from free RAM

    def validate(self) -> None:
        problems: list[str] = []
        if self.preset not in PRESETS:
            problems.append(f"--preset must be one of {', '.join(PRESETS)} (got {self.preset!r})")
        if self.target_bits is not None and self.max_kl is not None:
            problems.append("give --target-bits or --max-kl, not both")
        if self.target_bits is not None and not 2.0 <= self.target_bits <= 32.0:
            problems.append(f"--target-bits must be in [2, 32] (got {self.target_bits})")
        if self.max_kl is not None and self.max_kl <= 0:
            problems.append(f"--max-kl must be > 0 (got {self.max_kl})")
        if self.group_size not in Int4.GROUP_SIZES:
            problems.append(f"--group-size must be one of {Int4.GROUP_SIZES} (got {self.group_size})")
        if self.algorithm not in ("auto", *A.ALGORITHMS):
            problems.append(
                f"--algorithm must be auto or one of {', '.join(A.ALGORITHMS)} (got {self.algorithm!r})"
            )
        if self.sensitivity.method not in METHODS:
            problems.append(
                f"--sensitivity must be one of {', '.join(METHODS)} (got {self.sensitivity.method!r})"
            )
        if self.max_shard_size < 2**14:
            problems.append(f"--max-shard-size must be at least 16 KiB (got {self.max_shard_size} bytes)")
        if self.max_memory is not None and self.max_memory < 2**26:
            problems.append(f"--max-memory must be at least 64 MiB (got {self.max_memory} bytes)")
        if self.sensitivity.num_tokens < 16:
            problems.append("--sensitivity-tokens must be at least 16")
        if self.calib_tokens < 16:
            problems.append("--calib-tokens must be at least 16")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            problems.append(f"--smoothquant-alpha must be in [0, 1] (got {self.smoothquant_alpha})")
        if self.export not in (None, "compressed-tensors"):
            problems.append(f"--export must be compressed-tensors (got {self.export!r})")
        if not self.version.strip():
            problems.append("--version must not be empty")
        for text in self.schemes:
            try:
                if parse_scheme(text) is None:
                    problems.append("--schemes: fp32 is not a candidate (use --override to keep layers FP32)")
            except QpackError as exc:
                problems.append(f"--schemes: {exc}")
        try:
            PlanRules.parse(self.overrides)
        except QpackError as exc:
            problems.append(str(exc))
        if problems:
            raise QpackError("invalid quantize options: " + "; ".join(problems))


@dataclass
class QuantizeResult:
    output: Path
    manifest: dict[str, Any]
    plan: Plan
    seconds: float
    warnings: list[str]


def _candidates(config: QuantizeConfig) -> list[Scheme]:
    preset = PRESETS[config.preset]
    texts = config.schemes or preset.candidates
    schemes: list[Scheme] = []
    for text in texts:
        scheme = parse_scheme(text)
        assert scheme is not None
        if isinstance(scheme, Int4) and text.strip().lower() == "int4":
            scheme = Int4(group_size=config.group_size)
        if scheme not in schemes:
            schemes.append(scheme)
    return schemes


def _algorithm_for(scheme: Scheme, requested: str) -> str:
    if requested != "auto" and requested in scheme.algorithms:
        return requested
    default = DEFAULT_ALGORITHMS.get(scheme.type, "rtn")
    return default if default in scheme.algorithms else "rtn"


def build_plan(
    config: QuantizeConfig,
    model: nn.Module,
    calibration: CalibrationData,
    weights_sha: str,
    progress: Progress,
    warnings: list[str],
    load: Callable[[], nn.Module] | None = None,
    streamed: StreamedModel | None = None,
) -> tuple[Plan, SensitivityTable | None, list[Scheme], dict[str, Any]]:
    """The plan, resolved before any weight changes: overrides first, then the preset's candidates for the
    layers left free, uniformly or (under a size or KL budget) by measured sensitivity and the exact knapsack.
    A size budget below what the candidates can reach is refused before any sensitivity is measured."""
    shapes = linear_shapes(model)
    plan, free = _apply_rules(config, shapes, warnings)
    candidates = _candidates(config)
    per_layer = _layer_candidates(free, shapes, candidates, warnings)
    target_bits = config.target_bits if config.target_bits is not None else PRESETS[config.preset].target_bits
    info: dict[str, Any] = {"candidates": [s.label() for s in candidates], "target_bits": target_bits}
    table: SensitivityTable | None = None
    if all(len(v) == 1 for v in per_layer.values()) or (target_bits is None and config.max_kl is None):
        for fqn in free:
            plan.schemes[fqn] = min(per_layer[fqn], key=lambda s, f=fqn: s.bits_per_weight(*shapes[f]))
            plan.sources[fqn] = f"preset {config.preset}"
        info["planner"] = "uniform"
    else:
        if config.max_kl is None:
            assert target_bits is not None
            target_bits = _reachable_target(config, plan, per_layer, target_bits, warnings)
            info["target_bits"] = target_bits
        table, info["sensitivity_cache_hits"], info["sensitivity"] = measure_sensitivity(
            model,
            per_layer,
            calibration.heldout,
            config.sensitivity,
            weights_sha,
            calibration.path,
            progress,
            load,
            streamed,
            config.max_memory if config.max_memory is not None else int(0.9 * available_memory()),
        )
        _solve_budget(config, plan, per_layer, table, target_bits, info)
    for fqn, scheme in plan.schemes.items():
        if scheme is not None:
            plan.algorithms[fqn] = _algorithm_for(scheme, config.algorithm)
    plan.validate()
    return plan, table, candidates, info


def _apply_rules(
    config: QuantizeConfig, shapes: dict[str, tuple[int, int]], warnings: list[str]
) -> tuple[Plan, list[str]]:
    """The plan with every override applied and the head kept; the decoder linears left for the planner."""
    rules = PlanRules.parse(config.overrides)
    unmatched = rules.unmatched_patterns(shapes)
    embedding_hits = [p for p in unmatched if any(e in p for e in EMBEDDING_NAMES)]
    if embedding_hits:
        raise QpackError(
            f"--override {', '.join(embedding_hits)}: embeddings are not linears and always stay FP32"
        )
    if unmatched:
        raise QpackError(
            f"--override pattern(s) {', '.join(unmatched)} match no linear layer of this model "
            "(names look like model.layers.0.mlp.down_proj; prefix regexes with re:)"
        )
    plan = Plan(shapes=shapes)
    free: list[str] = []
    for fqn in shapes:
        matched, scheme, rule = rules.lookup(fqn, use_default=is_decoder_linear(fqn))
        if matched:
            plan.schemes[fqn] = scheme
            plan.sources[fqn] = f"override {rule}"
            if not is_decoder_linear(fqn) and scheme is not None:
                warnings.append(f"{fqn} forced to {scheme.label()} by --override; it is normally kept FP32")
        elif is_decoder_linear(fqn):
            free.append(fqn)
        else:
            plan.schemes[fqn] = None
            plan.sources[fqn] = "kept (head)"
    return plan, free


def _layer_candidates(
    free: list[str], shapes: dict[str, tuple[int, int]], candidates: list[Scheme], warnings: list[str]
) -> dict[str, list[Scheme]]:
    """The candidate schemes each free layer's shape allows (int8 where none does)."""
    per_layer: dict[str, list[Scheme]] = {}
    fallbacks: list[str] = []
    for fqn in free:
        valid = [s for s in candidates if not s.problems(*shapes[fqn])]
        if not valid:
            valid = [Int8()]
            fallbacks.append(fqn)
        per_layer[fqn] = valid
    if fallbacks:
        warnings.append(
            f"{len(fallbacks)} layers cannot use any candidate scheme (e.g. {fallbacks[0]} with in_features "
            f"{shapes[fallbacks[0]][0]}); they fall back to int8"
        )
    return per_layer


def _weights(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def _fixed_bits(plan: Plan) -> tuple[float, int]:
    """Storage bits and weights of the linears the rules already fixed to a scheme."""
    bits, weights = 0.0, 0
    for fqn, scheme in plan.schemes.items():
        if scheme is not None:
            bits += scheme.bits_per_weight(*plan.shapes[fqn]) * _weights(plan.shapes[fqn])
            weights += _weights(plan.shapes[fqn])
    return bits, weights


def _reachable_target(
    config: QuantizeConfig,
    plan: Plan,
    per_layer: dict[str, list[Scheme]],
    target_bits: float,
    warnings: list[str],
) -> float:
    """The size budget in bits per weight, checked against the range the candidates can reach (which depends
    on layer shapes only): an explicit --target-bits below it is an error, a preset's budget is raised to it."""
    fixed_bits, fixed_weights = _fixed_bits(plan)
    total = fixed_weights + sum(_weights(plan.shapes[f]) for f in per_layer)
    cheapest = {f: min(s.bits_per_weight(*plan.shapes[f]) for s in v) for f, v in per_layer.items()}
    dearest = {f: max(s.bits_per_weight(*plan.shapes[f]) for s in v) for f, v in per_layer.items()}
    floor = (fixed_bits + sum(cheapest[f] * _weights(plan.shapes[f]) for f in per_layer)) / total
    ceiling = (fixed_bits + sum(dearest[f] * _weights(plan.shapes[f]) for f in per_layer)) / total
    if target_bits >= floor:
        return target_bits
    if config.target_bits is not None:
        raise QpackError(
            f"size budget impossible: --target-bits {target_bits} is below the {floor:.3f} bits per weight these "
            f"layers need with the cheapest candidate schemes (reachable: {floor:.3f} to {ceiling:.3f}); raise "
            "--target-bits or add cheaper --scheme candidates"
        )
    warnings.append(
        f"the {config.preset} preset's {target_bits}-bit budget is below this model's floor of "
        f"{floor:.3f} bits (some layers cannot use the cheapest scheme); using {floor:.3f}"
    )
    return floor


def _solve_budget(
    config: QuantizeConfig,
    plan: Plan,
    per_layer: dict[str, list[Scheme]],
    table: SensitivityTable,
    target_bits: float | None,
    info: dict[str, Any],
) -> None:
    """Each free layer's scheme from the exact knapsack over measured sensitivity, under --max-kl (fewest bits)
    or the size budget (least predicted KL)."""
    layers = {
        fqn: [
            Option(
                s, s.bits_per_weight(*plan.shapes[fqn]) * _weights(plan.shapes[fqn]), table.value(fqn, s)[0]
            )
            for s in schemes
        ]
        for fqn, schemes in per_layer.items()
    }
    if config.max_kl is not None:
        chosen, predicted = solve(layers, max_kl=config.max_kl)
    else:
        assert target_bits is not None
        fixed_bits, fixed_weights = _fixed_bits(plan)
        total = fixed_weights + sum(_weights(plan.shapes[f]) for f in per_layer)
        chosen, predicted = solve(layers, budget_bits=target_bits * total - fixed_bits + 1e-6)
    for fqn, option in chosen.items():
        plan.schemes[fqn] = option.scheme
        plan.sources[fqn] = "planner"
    info["planner"] = "exact knapsack (DP)"
    info["predicted_kl"] = predicted
    info["budget"] = {"max_kl": config.max_kl} if config.max_kl is not None else {"target_bits": target_bits}


def _check_calibration_matches(source: ModelSource, calibration: CalibrationData, weights_sha: str) -> None:
    expected = calibration.weights_sha256
    if expected and expected != weights_sha:
        raise QpackError(
            f"calibration {calibration.path} was built for model {calibration.manifest['model'].get('id')!r} "
            f"(weights {expected[:12]}), not {source.model_id!r} (weights {weights_sha[:12]}); "
            "re-run qpack calibrate with this --model"
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

    @property
    def model(self) -> nn.Module:
        return self.streamed.model


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
    streamed = StreamedModel(source.path)
    check_memory(streamed, config.calib_tokens + 2 * config.eval_tokens, config.max_memory)
    timings["load"] = time.perf_counter() - phase
    return _Inputs(output, calibration, source, weights_sha, streamed)


def _quantize_and_measure(
    inputs: _Inputs,
    plan: Plan,
    config: QuantizeConfig,
    writer: ArtifactWriter,
    progress: Progress,
    timings: dict[str, float],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """One pass over the blocks: quantize and write each, carrying held-out tokens through the FP32 and the
    quantized block; then KL, top-1 and perplexities of the two."""
    phase = time.perf_counter()
    packs = eval_packs(inputs.calibration, config.eval_tokens, config.seed)
    lw = LayerwiseModel(inputs.streamed)
    result = quantize_blockwise(lw, plan, inputs.calibration, config, writer, packs, progress)
    lw.forget_rope()
    timings["quantize"] = time.perf_counter() - phase
    phase = time.perf_counter()
    with progress.task("Measuring the artifact against FP32 on held-out tokens"):
        quality = compare_hidden(
            packs, result.reference, result.candidate, result.reference_head, result.candidate_head
        )
    quality["numerics"] = {"prefill_dtype": "float32", "native_kernels": kernels.isa()}
    timings["evaluate"] = time.perf_counter() - phase
    return result.info, quality


def _manifest(
    config: QuantizeConfig,
    inputs: _Inputs,
    info: dict[str, Any],
    module_info: dict[str, dict[str, Any]],
    table: SensitivityTable | None,
    quality: dict[str, Any],
    timings: dict[str, float],
    warnings: list[str],
) -> dict[str, Any]:
    """The manifest's provenance, plan and quality sections (the artifact writer adds files, sizes, hashes)."""
    source, calibration = inputs.source, inputs.calibration
    return {
        "name": config.name or f"{source.model_id.rsplit('/', 1)[-1]}-{config.preset}",
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
            "preset": config.preset,
            "plan_info": {k: v for k, v in info.items() if k != "summary"},
            "summary": info["summary"],
            "overrides": PlanRules.parse(config.overrides).to_json(),
            "gptq": dataclasses.asdict(config.gptq),
            "awq": dataclasses.asdict(config.awq),
            "calib_tokens": config.calib_tokens,
            "module_info": module_info,
            "warnings": warnings,
        },
        "sensitivity": None
        if table is None
        else {"method": table.method, "tokens": table.num_tokens, "rows": table.rows()},
        "quality": quality,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "memory": {
            "peak_blocks_materialized": inputs.streamed.peak_blocks,
            "block_loads": inputs.streamed.loads,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        },
        "evals": {},
    }


def quantize_model(
    config: QuantizeConfig,
    progress: Progress = NULL_PROGRESS,
    on_plan: Callable[[Plan, dict[str, Any]], None] | None = None,
) -> QuantizeResult:
    """Load and check the inputs, plan (shown through `on_plan` before any weight changes), quantize and
    measure, write the artifact atomically, export if asked."""
    from quantize.report import heatmap_png

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
        inputs.weights_sha,
        progress,
        warnings,
        lambda: load_model(inputs.source),
        inputs.streamed,
    )
    timings["plan"] = time.perf_counter() - phase
    info["summary"] = plan.summary(kept_module_names(inputs.model))
    if on_plan is not None:
        on_plan(plan, info)
    with artifact_writer(inputs.output, config.overwrite, config.max_shard_size) as writer:
        module_info, quality = _quantize_and_measure(inputs, plan, config, writer, progress, timings)
        quality["predicted_kl"] = info.get("predicted_kl")
        heatmap = heatmap_png(plan, table, candidates) if table is not None else heatmap_png(plan, None, [])
        phase = time.perf_counter()
        manifest = finish_artifact(
            writer,
            config=_complete_config(inputs.model),
            plan=plan,
            source_dir=inputs.source.path,
            manifest=_manifest(config, inputs, info, module_info, table, quality, timings, warnings),
            heatmap=heatmap,
        )
    timings["save"] = time.perf_counter() - phase
    if config.export == "compressed-tensors":
        from quantize.export import export_compressed_tensors

        output = inputs.output
        manifest["export"] = export_compressed_tensors(
            output, output.parent / f"{output.name}-compressed-tensors", config.overwrite
        )
    return QuantizeResult(inputs.output, manifest, plan, time.perf_counter() - started, warnings)
