"""`qpack calibrate`: options (built from `calibrate.CalibrationConfig`) -> `calibrate.run_calibration` -> tables."""

from __future__ import annotations

from typing import Any

import typer

from calibrate.config import CalibrationConfig
from qpack.cli import options as opt
from qpack.cli.app import app, memory_limit, output, run
from qpack.cli.fields import Option, Options
from qpack.cli.render import calibration_tables

CALIBRATE = Options(
    CalibrationConfig,
    [
        Option("output", ("--output", "-o"), default="calibration"),
        Option("model", ("--model", "-m"), default="smollm2-135m"),
        Option("queries", ("--queries",)),
        "format",
        "field",
        "turns",
        Option("chat_template", ("--chat-template/--no-chat-template",)),
        "min_tokens",
        "max_tokens",
        Option("num_samples", ("--num-samples", "-n")),
        Option("heldout_fraction", ("--heldout",)),
        "seed",
        Option("reference", ("--reference",)),
        Option("coverage.max_token_js", ("--max-token-js",)),
        Option("coverage.max_length_js", ("--max-length-js",)),
        "keep_text",
        Option("token_budget", ("--batch-tokens",)),
        Option("max_memory", ("--max-memory",), str | None, None, memory_limit, help=opt.MAX_MEMORY_HELP),
        "overwrite",
    ],
    "calibration",
)


@app.command(help="Clean, scrub and sample real user queries; record activation statistics.")
@CALIBRATE.command
def calibrate(ctx: typer.Context, **values: Any) -> None:
    from calibrate import run_calibration

    out = output(ctx)
    config = run(out, lambda: CALIBRATE.config(values))
    result = run(out, lambda: CALIBRATE.translated(lambda: run_calibration(config, out.progress())))
    coverage = result.manifest.get("coverage")
    if coverage and not coverage["covered"]:
        for warning in coverage["warnings"]:
            out.warn(f"calibration set does not cover production traffic: {warning}")
    out.result(
        {"ok": True, **result.to_json()}, *calibration_tables(result.manifest, result.output, result.seconds)
    )
