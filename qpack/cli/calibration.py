"""`qpack calibrate`: options -> `calibrate.run_calibration` -> tables."""

from __future__ import annotations

from pathlib import Path

import typer

from qpack.cli import options as opt
from qpack.cli.app import app, memory_limit, output, run
from qpack.cli.render import calibration_tables


@app.command(help="Clean, scrub and sample real user queries; record activation statistics.")
def calibrate(
    ctx: typer.Context,
    out_dir: Path = typer.Option(
        Path("calibration"), "--output", "-o", help="Calibration directory to write."
    ),
    model: opt.ModelSpec = "smollm2-135m",
    queries: opt.Queries = [],  # noqa: B006 - typer copies list defaults
    fmt: str | None = typer.Option(
        None, "--format", help="Force the input format (default: from the extension)."
    ),
    field_name: str | None = typer.Option(
        None, "--field", help="Field/column holding the query or messages."
    ),
    turns: str = typer.Option("first", "--turns", help="Which user turns to use: first or all."),
    chat_template: bool = typer.Option(
        True, "--chat-template/--no-chat-template", help="Render samples with the model's chat template."
    ),
    min_tokens: int = typer.Option(4, "--min-tokens", help="Drop samples shorter than this (tokens)."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Drop samples longer than this (tokens)."),
    num_samples: opt.NumSamples = 512,
    heldout: float = typer.Option(
        0.1, "--heldout", help="Fraction of the samples held out for PPL/KL checks."
    ),
    seed: opt.Seed = 0,
    reference: list[Path] = typer.Option(
        [], "--reference", help="A sample of production traffic to check coverage against."
    ),
    max_token_js: float = typer.Option(0.45, "--max-token-js", help="Coverage warning: token JS above this."),
    max_length_js: float = typer.Option(
        0.25, "--max-length-js", help="Coverage warning: length JS above this."
    ),
    keep_text: bool = typer.Option(False, "--keep-text", help="Also store the (scrubbed) query text."),
    batch_tokens: int = typer.Option(4096, "--batch-tokens", help="Padded tokens per forward batch."),
    max_memory: opt.MaxMemory = None,
    overwrite: opt.Overwrite = False,
) -> None:
    from calibrate import CalibrationConfig, run_calibration
    from calibrate.coverage import CoverageThresholds

    out = output(ctx)
    config = CalibrationConfig(
        output=out_dir,
        model=model,
        queries=tuple(str(q) for q in queries),
        format=fmt,
        field=field_name,
        turns=turns,
        chat_template=chat_template,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        num_samples=num_samples,
        heldout_fraction=heldout,
        seed=seed,
        reference=tuple(str(r) for r in reference),
        coverage=CoverageThresholds(max_token_js=max_token_js, max_length_js=max_length_js),
        keep_text=keep_text,
        overwrite=overwrite,
        token_budget=batch_tokens,
        max_memory=run(out, lambda: memory_limit(max_memory)),
    )
    result = run(out, lambda: run_calibration(config, out.progress()))
    coverage = result.manifest.get("coverage")
    if coverage and not coverage["covered"]:
        for warning in coverage["warnings"]:
            out.warn(f"calibration set does not cover production traffic: {warning}")
    data = {
        "ok": True,
        "output": str(result.output),
        "seconds": round(result.seconds, 2),
        "manifest": result.manifest,
    }
    out.result(data, *calibration_tables(result.manifest, result.output, result.seconds))
