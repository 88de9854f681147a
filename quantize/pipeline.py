"""`qpack quantize`: calibration directory + model in, verified mixed-precision artifact out.

Order of work: validate every option (all problems reported at once), check the calibration was built for
this exact model (weights hash), resolve the plan rules, measure sensitivity of the layers the planner is
free to choose for (cached), solve the plan under the budget and show it *before* touching the model, then
quantize block by block (scale folding, GPTQ/RTN), measure the result against FP32 on held-out tokens, and
write the artifact atomically.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize import algorithms as A
from quantize.artifact import save_artifact
from quantize.calibdata import CalibrationData, ChannelStats
from quantize.errors import QpackError
from quantize.fileio import check_output_dir
from quantize.handlers import handler_for
from quantize.layerwise import (
    LayerwiseModel,
    Pack,
    input_hessians,
    make_packs,
    next_token_targets,
    sample_sequences,
)
from quantize.models import ModelSource, load_model, resolve_model, weights_sha256
from quantize.plan import EMBEDDING_NAMES, Plan, PlanRules, is_decoder_linear
from quantize.planner import Option, solve
from quantize.progress import NULL_PROGRESS, Progress
from quantize.schemes import W8A8, Int4, Int8, Scheme, parse_scheme
from quantize.sensitivity import METHODS, SensitivityConfig, SensitivityTable, measure_sensitivity
from quantize.surgery import (
    QuantizedWeight,
    fold_input_scale,
    get_module,
    input_groups,
    install,
    kept_module_names,
    linear_shapes,
)


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
    model: nn.Module | None = None


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
) -> tuple[Plan, SensitivityTable | None, list[Scheme], dict[str, Any]]:
    shapes = linear_shapes(model)
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
    candidates = _candidates(config)
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
    per_layer: dict[str, list[Scheme]] = {}
    fallbacks: list[str] = []
    for fqn in free:
        in_features, out_features = shapes[fqn]
        valid = [s for s in candidates if not s.problems(in_features, out_features)]
        if not valid:
            valid = [Int8()]
            fallbacks.append(fqn)
        per_layer[fqn] = valid
    if fallbacks:
        warnings.append(
            f"{len(fallbacks)} layers cannot use any candidate scheme (e.g. {fallbacks[0]} with in_features "
            f"{shapes[fallbacks[0]][0]}); they fall back to int8"
        )
    preset = PRESETS[config.preset]
    target_bits = config.target_bits if config.target_bits is not None else preset.target_bits
    uniform = all(len(v) == 1 for v in per_layer.values()) or (target_bits is None and config.max_kl is None)
    info: dict[str, Any] = {"candidates": [s.label() for s in candidates], "target_bits": target_bits}
    table: SensitivityTable | None = None
    if uniform:
        for fqn in free:
            plan.schemes[fqn] = min(per_layer[fqn], key=lambda s, f=fqn: s.bits_per_weight(*shapes[f]))
            plan.sources[fqn] = f"preset {config.preset}"
        info["planner"] = "uniform"
    else:
        table, hits = measure_sensitivity(
            model, per_layer, calibration.heldout, config.sensitivity, weights_sha, calibration.path, progress
        )
        info["sensitivity_cache_hits"] = hits
        layers: dict[str, list[Option]] = {}
        for fqn in free:
            n = shapes[fqn][0] * shapes[fqn][1]
            layers[fqn] = [
                Option(s, s.bits_per_weight(*shapes[fqn]) * n, table.value(fqn, s)[0]) for s in per_layer[fqn]
            ]
        fixed_bits = 0.0
        fixed_weights = 0
        for fqn, scheme in plan.schemes.items():
            if scheme is not None:
                n = shapes[fqn][0] * shapes[fqn][1]
                fixed_bits += scheme.bits_per_weight(*shapes[fqn]) * n
                fixed_weights += n
        if config.max_kl is not None:
            chosen, predicted = solve(layers, max_kl=config.max_kl)
        else:
            assert target_bits is not None
            total_weights = fixed_weights + sum(shapes[f][0] * shapes[f][1] for f in free)
            floor_bits = (fixed_bits + sum(min(o.bits for o in layers[f]) for f in free)) / total_weights
            if target_bits < floor_bits:
                if config.target_bits is not None:
                    raise QpackError(
                        f"size budget impossible: --target-bits {target_bits} is below the {floor_bits:.3f} bits per "
                        "weight these layers need with the cheapest candidate schemes; raise --target-bits"
                    )
                warnings.append(
                    f"the {config.preset} preset's {target_bits}-bit budget is below this model's floor of "
                    f"{floor_bits:.3f} bits (some layers cannot use the cheapest scheme); using {floor_bits:.3f}"
                )
                target_bits = floor_bits
                info["target_bits"] = target_bits
            chosen, predicted = solve(layers, budget_bits=target_bits * total_weights - fixed_bits + 1e-6)
        for fqn, option in chosen.items():
            plan.schemes[fqn] = option.scheme
            plan.sources[fqn] = "planner"
        info["planner"] = "exact knapsack (DP)"
        info["predicted_kl"] = predicted
        info["budget"] = (
            {"max_kl": config.max_kl} if config.max_kl is not None else {"target_bits": target_bits}
        )
    for fqn, scheme in plan.schemes.items():
        if scheme is not None:
            plan.algorithms[fqn] = _algorithm_for(scheme, config.algorithm)
    plan.validate()
    return plan, table, candidates, info


def _rms(stats: dict[str, ChannelStats], fqn: str, hessian: torch.Tensor | None, tokens: int) -> torch.Tensor:
    if fqn in stats:
        return stats[fqn].mean_sq.to(torch.float32).clamp_min(0).sqrt()
    assert hessian is not None
    return (torch.diag(hessian) / max(tokens, 1)).clamp_min(0).sqrt()


def quantize_layers(
    model: nn.Module,
    plan: Plan,
    calibration: CalibrationData,
    config: QuantizeConfig,
    progress: Progress = NULL_PROGRESS,
) -> dict[str, QuantizedWeight]:
    """Block by block: fold AWQ/SmoothQuant scales, quantize with GPTQ/RTN, propagate through fake-quant weights."""
    lw = LayerwiseModel(model)
    sequences = sample_sequences(calibration.train, config.calib_tokens, config.seed)
    packs = make_packs(sequences, 512, share_prefix=True)
    num_tokens = int(sum(p.represented_tokens for p in packs))
    records: dict[str, QuantizedWeight] = {}
    groups = input_groups(model)
    with torch.inference_mode():
        hidden = [lw.embed(p) for p in packs]
    with progress.task(
        f"Quantizing {lw.num_layers} blocks on {num_tokens:,} calibration tokens", total=lw.num_layers
    ) as task:
        for index in range(lw.num_layers):
            block_groups = [g for g in groups if g.block == index]
            planned = {
                m: plan.schemes[m] for g in block_groups for m in g.members if plan.schemes.get(m) is not None
            }
            needs = {plan.algorithms[m] for m in planned} & {"gptq", "awq", "smoothquant"}
            heads = {g.name: g.members[0] for g in block_groups}
            hessians = (
                input_hessians(
                    lw, index, {g: get_module(model, fqn) for g, fqn in heads.items()}, hidden, packs
                )
                if needs
                else {}
            )
            smooth: dict[str, torch.Tensor] = {}
            info: dict[str, dict[str, Any]] = {}
            with torch.no_grad():
                for group in block_groups:
                    members = [m for m in group.members if m in planned]
                    if not members:
                        continue
                    algorithms = {plan.algorithms[m] for m in members}
                    weights = [get_module(model, m).weight.detach().to(torch.float32) for m in group.members]
                    h = hessians.get(group.name)
                    s: torch.Tensor | None = None
                    if "smoothquant" in algorithms:
                        stat = calibration.stats.get(group.members[0])
                        abs_max = stat.abs_max if stat is not None else torch.diag(h).sqrt()  # type: ignore[arg-type]
                        s = A.smoothquant_factor(weights, abs_max, config.smoothquant_alpha)
                        for m in members:
                            info.setdefault(m, {})["smoothquant_alpha"] = config.smoothquant_alpha
                    elif "awq" in algorithms and group.predecessor is not None and h is not None:
                        schemes = [
                            plan.schemes.get(m) if plan.algorithms.get(m) == "awq" else None
                            for m in group.members
                        ]
                        s, alpha = A.awq_search(
                            weights,
                            schemes,
                            h,
                            _rms(calibration.stats, group.members[0], h, num_tokens),
                            config.awq,
                        )
                        for m in members:
                            info.setdefault(m, {})["awq_alpha"] = alpha
                    if s is not None:
                        if group.predecessor is not None:
                            fold_input_scale(model, group, s)
                        else:
                            for m in members:
                                if isinstance(plan.schemes[m], W8A8):
                                    smooth[m] = s
                                    get_module(model, m).weight.mul_(s[None, :])
                        if h is not None and group.predecessor is not None:
                            hessians[group.name] = h / s[:, None] / s[None, :]
                for group in block_groups:
                    prepared: A.PreparedHessian | None = None
                    for fqn in group.members:
                        scheme = plan.schemes.get(fqn)
                        if scheme is None:
                            continue
                        linear = get_module(model, fqn)
                        assert isinstance(linear, nn.Linear), fqn
                        algorithm = plan.algorithms[fqn]
                        weight = linear.weight.detach().to(torch.float32)
                        h = hessians.get(group.name)
                        if algorithm == "gptq" and h is not None and isinstance(scheme, Int8 | Int4 | W8A8):
                            prepared = prepared or A.prepare_hessian(h, config.gptq)
                            tensors = A.gptq(scheme, weight, prepared, config.gptq)
                        else:
                            tensors = A.rtn(scheme, weight)
                        if fqn in smooth:
                            tensors["smooth"] = smooth[fqn].to(torch.float32)
                        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
                        records[fqn] = QuantizedWeight(scheme, algorithm, tensors, bias, info.get(fqn, {}))
                        dequantized = handler_for(scheme).dequantize(scheme, tensors)
                        linear.weight.copy_(dequantized.to(linear.weight.dtype))
            with torch.inference_mode():
                hidden = [lw.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
            task.advance()
    for fqn, scheme in plan.quantized().items():
        if fqn in records:
            continue
        linear = get_module(model, fqn)
        assert isinstance(linear, nn.Linear), fqn
        weight = linear.weight.detach().to(torch.float32)
        if plan.algorithms[fqn] == "gptq" and isinstance(scheme, Int8 | Int4 | W8A8) and fqn == "lm_head":
            with torch.inference_mode():
                normed = [
                    lw.norm(h)[0] * p.weights[:, None].sqrt() for h, p in zip(hidden, packs, strict=True)
                ]
            x = torch.cat(normed)
            tensors = A.gptq(scheme, weight, x.t() @ x, config.gptq)
        else:
            tensors = A.rtn(scheme, weight)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
        records[fqn] = QuantizedWeight(scheme, plan.algorithms[fqn], tensors, bias)
    lw.forget_rope()
    return records


def _eval_packs(calibration: CalibrationData, tokens: int, seed: int) -> list[Pack]:
    return make_packs(sample_sequences(calibration.heldout, tokens, seed + 1), 512)


@torch.inference_mode()
def reference_hidden(model: nn.Module, packs: list[Pack]) -> list[torch.Tensor]:
    lw = LayerwiseModel(model)
    out = [lw.final_hidden(p)[0] for p in packs]
    lw.forget_rope()
    return out


@torch.inference_mode()
def compare_to_reference(
    model: nn.Module,
    packs: list[Pack],
    reference: list[torch.Tensor],
    reference_head: nn.Module,
    chunk: int = 128,
) -> dict[str, float]:
    """KL, top-1 agreement and perplexities of `model` against FP32 final hidden states on held-out packs.

    Logits are formed `chunk` positions at a time (a 49k vocabulary at 512 positions is 100 MB per copy).
    """
    lw = LayerwiseModel(model)
    kl, top1, nll_ref, nll_q = [], [], [], []
    for pack, ref in zip(packs, reference, strict=True):
        candidate = lw.final_hidden(pack)[0]
        targets = next_token_targets(pack)
        for part in range(0, pack.num_tokens, chunk):
            rows = slice(part, min(part + chunk, pack.num_tokens))
            ref_logp = torch.log_softmax(reference_head(ref[rows]).float(), -1)
            cand_logp = torch.log_softmax(lw.lm_head(candidate[rows]).float(), -1)
            kl.append((ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).clamp_min(0))
            top1.append(ref_logp.argmax(-1) == cand_logp.argmax(-1))
            t = targets[rows]
            valid = t >= 0
            idx = t.clamp_min(0)[:, None]
            nll_ref.append(-ref_logp.gather(1, idx)[:, 0][valid])
            nll_q.append(-cand_logp.gather(1, idx)[:, 0][valid])
            del ref_logp, cand_logp
    lw.forget_rope()
    kl_all, nll_r, nll_c = torch.cat(kl), torch.cat(nll_ref), torch.cat(nll_q)
    return {
        "tokens": int(kl_all.numel()),
        "kl": float(kl_all.mean()),
        "kl_p95": float(torch.quantile(kl_all, 0.95)),
        "top1_agreement": float(torch.cat(top1).float().mean()),
        "ppl_reference": float(math.exp(float(nll_r.mean()))),
        "ppl": float(math.exp(float(nll_c.mean()))),
    }


def _check_calibration_matches(source: ModelSource, calibration: CalibrationData, weights_sha: str) -> None:
    expected = calibration.weights_sha256
    if expected and expected != weights_sha:
        raise QpackError(
            f"calibration {calibration.path} was built for model {calibration.manifest['model'].get('id')!r} "
            f"(weights {expected[:12]}), not {source.model_id!r} (weights {weights_sha[:12]}); "
            "re-run qpack calibrate with this --model"
        )


def quantize_model(
    config: QuantizeConfig,
    progress: Progress = NULL_PROGRESS,
    on_plan: Callable[[Plan, dict[str, Any]], None] | None = None,
) -> QuantizeResult:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    warnings: list[str] = []
    config.validate()
    output = Path(config.output).expanduser().resolve()
    check_output_dir(output, config.overwrite, "artifact directory")
    calibration = CalibrationData.load(config.calibration)
    source = resolve_model(config.model or calibration.manifest["model"].get("id"), progress)
    weights_sha = weights_sha256(source)
    _check_calibration_matches(source, calibration, weights_sha)
    torch.manual_seed(config.seed)
    phase = time.perf_counter()
    model = load_model(source)
    timings["load"] = time.perf_counter() - phase

    phase = time.perf_counter()
    plan, table, candidates, info = build_plan(config, model, calibration, weights_sha, progress, warnings)
    timings["plan"] = time.perf_counter() - phase
    kept = kept_module_names(model)
    info["summary"] = plan.summary(kept)
    if on_plan is not None:
        on_plan(plan, info)

    phase = time.perf_counter()
    eval_packs = _eval_packs(calibration, config.eval_tokens, config.seed)
    reference = reference_hidden(model, eval_packs)
    reference_head = model.lm_head
    if plan.schemes.get("lm_head") is not None:
        reference_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        reference_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    records = quantize_layers(model, plan, calibration, config, progress)
    timings["quantize"] = time.perf_counter() - phase

    for fqn, record in records.items():
        install(model, fqn, record)
    phase = time.perf_counter()
    with progress.task("Measuring the artifact against FP32 on held-out tokens"):
        quality = compare_to_reference(model, eval_packs, reference, reference_head)
    timings["evaluate"] = time.perf_counter() - phase
    quality["predicted_kl"] = info.get("predicted_kl")

    from quantize.report import heatmap_png

    heatmap = heatmap_png(plan, table, candidates) if table is not None else heatmap_png(plan, None, [])
    manifest_in = {
        "name": config.name or f"{source.model_id.rsplit('/', 1)[-1]}-{config.preset}",
        "version": config.version,
        "source": {
            "model_id": source.model_id,
            "kind": source.kind,
            "model_type": source.model_type,
            "architecture": source.architecture,
            "weights_sha256": weights_sha,
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
            "module_info": {fqn: r.info for fqn, r in records.items() if r.info},
            "warnings": warnings,
        },
        "sensitivity": None
        if table is None
        else {
            "method": table.method,
            "tokens": table.num_tokens,
            "rows": table.rows(),
        },
        "quality": quality,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "evals": {},
    }
    phase = time.perf_counter()
    manifest = save_artifact(
        output,
        model=model,
        plan=plan,
        records=records,
        source_dir=source.path,
        manifest=manifest_in,
        heatmap=heatmap,
        overwrite=config.overwrite,
    )
    timings["save"] = time.perf_counter() - phase
    if config.export == "compressed-tensors":
        from quantize.export import export_compressed_tensors

        manifest["export"] = export_compressed_tensors(
            output, output.parent / f"{output.name}-compressed-tensors", config.overwrite
        )
    return QuantizeResult(output, manifest, plan, time.perf_counter() - started, warnings, model)
