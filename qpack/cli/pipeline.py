"""`qpack build`: options -> `qpack.build.run_build` (calibrate -> quantize -> evaluate) -> one summary."""

from __future__ import annotations

from pathlib import Path

import typer

from evals.config import Gate
from qpack.cli import options as opt
from qpack.cli.app import app, formats, gate_exit, output, run
from qpack.cli.evaluation import named_by_flags
from qpack.cli.render import build_table, eval_tables


@app.command(help="calibrate → quantize → evaluate with a gate, in one command for CI.")
def build(
    ctx: typer.Context,
    out_dir: Path = typer.Option(..., "--output", "-o", help="Artifact directory to write."),
    model: opt.ModelSpec = None,
    queries: opt.Queries = [],  # noqa: B006 - typer copies list defaults
    calibration: Path | None = typer.Option(None, "--calibration", help="Reuse this calibration directory."),
    num_samples: opt.NumSamples = 512,
    preset: opt.Preset = "mixed",
    target_bits: opt.TargetBits = None,
    override: opt.Overrides = [],  # noqa: B006
    name: opt.Name = None,
    version: opt.Version = "1",
    mmlu: opt.Mmlu = None,
    subjects: opt.Subjects = None,
    limit: int | None = typer.Option(5, "--limit", help="MMLU questions per subject (0 = all)."),
    shots: opt.Shots = 5,
    fmt: opt.Format = "letter",
    max_drift: opt.MaxDrift = None,
    max_kl: opt.MaxKL = None,
    max_flip_rate: opt.MaxFlipRate = None,
    overwrite: opt.Overwrite = False,
    seed: opt.Seed = 0,
) -> None:
    from qpack.build import BuildConfig, run_build

    out = output(ctx)
    config = BuildConfig(
        output=out_dir,
        model=model,
        queries=tuple(str(q) for q in queries),
        calibration=calibration,
        num_samples=num_samples,
        preset=preset,
        target_bits=target_bits,
        overrides=tuple(override),
        name=name,
        version=version,
        mmlu=mmlu,
        subjects=subjects,
        limit=None if limit == 0 else limit,
        shots=shots,
        formats=formats(fmt),
        gate=Gate(max_drift=max_drift, max_kl=max_kl, max_flip_rate=max_flip_rate),
        overwrite=overwrite,
        seed=seed,
    )
    built = run(
        out, lambda: named_by_flags("build options", lambda: run_build(config, out.progress()), BuildConfig)
    )
    manifest = built.quantized.manifest
    out.result(built.summary, build_table(built.summary, manifest), *eval_tables(built.evaluated.evaluation))
    gate_exit(out, built.evaluated.passed, built.evaluated.reasons)
