"""`qpack quantize` and `qpack inspect`: options -> `quantize.pipeline.quantize_model` / the artifact reader ->
plan and artifact tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from qpack.cli import options as opt
from qpack.cli.app import app, memory_limit, output, run, sizes
from qpack.cli.render import artifact_table, inspect_table, plan_summary, plan_table


@app.command(help="Quantize a model with layer-wise mixed precision into a versioned artifact.")
def quantize(
    ctx: typer.Context,
    calibration: opt.Calibration,
    out_dir: Path = typer.Option(..., "--output", "-o", help="Artifact directory to write."),
    model: opt.ModelSpec = None,
    name: opt.Name = None,
    version: opt.Version = "1",
    preset: opt.Preset = "mixed",
    target_bits: opt.TargetBits = None,
    max_kl: opt.MaxKLBudget = None,
    schemes: opt.Schemes = [],  # noqa: B006 - typer copies list defaults
    group_size: opt.GroupSize = 64,
    override: opt.Overrides = [],  # noqa: B006
    algorithm: opt.Algorithm = "auto",
    sensitivity: opt.Sensitivity = "auto",
    sensitivity_budget: opt.SensitivityBudget = 10.0,
    sensitivity_tokens: opt.SensitivityTokens = 256,
    calib_tokens: opt.CalibTokens = 4096,
    eval_tokens: opt.EvalTokens = 2048,
    act_order: opt.ActOrder = True,
    damp: opt.Damp = 0.01,
    smoothquant_alpha: opt.SmoothQuantAlpha = 0.5,
    export: opt.Export = None,
    seed: int = typer.Option(0, "--seed", help="Seed for token sampling."),
    max_shard_size: opt.MaxShardSize = "2GB",
    max_memory: opt.MaxMemory = None,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing artifact."),
) -> None:
    from quantize.algorithms import GPTQConfig
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model
    from quantize.sensitivity.measure import SensitivityConfig

    out = output(ctx)
    config = QuantizeConfig(
        output=out_dir,
        calibration=calibration,
        model=model,
        name=name,
        version=version,
        preset=preset,
        target_bits=target_bits,
        max_kl=max_kl,
        schemes=tuple(schemes),
        group_size=group_size,
        overrides=tuple(override),
        algorithm=algorithm,
        gptq=GPTQConfig(damp=damp, act_order=act_order),
        smoothquant_alpha=smoothquant_alpha,
        sensitivity=SensitivityConfig(
            method=sensitivity, num_tokens=sensitivity_tokens, seed=seed, budget_minutes=sensitivity_budget
        ),
        calib_tokens=calib_tokens,
        eval_tokens=eval_tokens,
        export=export,
        overwrite=overwrite,
        seed=seed,
        max_shard_size=run(out, lambda: sizes(max_shard_size, "--max-shard-size")),
        max_memory=run(out, lambda: memory_limit(max_memory)),
    )

    def on_plan(plan: Any, info: dict[str, Any]) -> None:
        if not out.quiet and not out.json_mode:
            out.stderr.print(plan_table(plan))
            out.stderr.print(plan_summary(plan, info))

    result = run(out, lambda: quantize_model(config, out.progress(), on_plan))
    for warning in result.warnings:
        out.warn(warning)
    manifest = result.manifest
    data = {
        "ok": True,
        "output": str(result.output),
        "seconds": round(result.seconds, 2),
        "manifest": manifest,
    }
    out.result(data, artifact_table(manifest, result.output, result.seconds))


@app.command(help="Print an artifact's manifest: plan, sizes, quality, evals; verify its hashes.")
def inspect(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check every file's sha256."),
) -> None:
    from quantize.io.artifact import read_manifest, verify_artifact
    from quantize.planning.plan import Plan

    out = output(ctx)

    def load() -> dict[str, Any]:
        manifest = read_manifest(artifact)
        if verify:
            verify_artifact(artifact, manifest)
        return manifest

    manifest = run(out, load)
    plan = Plan.from_json(manifest["modules"])
    out.result(manifest, plan_table(plan), inspect_table(manifest, plan, verify))
