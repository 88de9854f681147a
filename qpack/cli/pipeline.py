"""`qpack build`: options (built from `qpack.build.BuildConfig`: its calibration, quantize and evaluate stages) ->
`qpack.build.run_build` (calibrate -> quantize -> evaluate) -> one summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from qpack.build import BuildConfig
from qpack.cli.app import app, formats, gate_exit, output, run
from qpack.cli.fields import Option, Options, choice
from qpack.cli.render import build_table, eval_tables
from quantize.common.config import Problems
from quantize.planning.plan import PlanRules
from quantize.planning.presets import PRESETS


def _linked(values: dict[str, Any], _problems: Problems) -> dict[str, Any]:
    """The paths that tie the stages: the calibration directory (--calibration, else ARTIFACT.calibration) and the
    artifact the evaluation reads."""
    artifact = Path(values["quantize_output"])
    calibration = values["calibration_dir"] or artifact.with_name(artifact.name + ".calibration")
    return {
        "quantize.calibration": calibration,
        "calibration.output": calibration,
        "evaluate.artifact": artifact,
        "evaluate.calibration": calibration,
    }


BUILD = Options(
    BuildConfig,
    [
        Option("quantize.output", ("--output", "-o")),
        Option("quantize.model", ("--model", "-m"), also=("calibration.model",)),
        Option("calibration.queries", ("--queries",)),
        Option(
            "",
            ("--calibration",),
            Path | None,
            None,
            help="Reuse this calibration directory (default: ARTIFACT.calibration, built when it is missing).",
            name="calibration_dir",
        ),
        Option("calibration.num_samples", ("--num-samples", "-n")),
        Option("quantize.preset", ("--preset", "-p"), str, "mixed", choice(PRESETS, "quantize.preset")),
        Option("quantize.target_bits", ("--target-bits",)),
        Option(
            "quantize.overrides",
            ("--override",),
            list[str],
            [],
            PlanRules.parse,
            help="PATTERN=SCHEME, e.g. 're:.*down_proj=int8' (repeatable; fp32 keeps a layer FP32).",
        ),
        Option("quantize.name", ("--name",)),
        Option("quantize.version", ("--version",)),
        Option("evaluate.mmlu", ("--mmlu",)),
        Option("evaluate.subjects", ("--subjects",)),
        Option(
            "evaluate.limit",
            ("--limit",),
            int,
            5,
            lambda n: None if n == 0 else n,
            help="MMLU questions per subject (0 = all).",
        ),
        Option("evaluate.shots", ("--shots",)),
        Option("evaluate.formats", ("--format",), str, "letter", formats, help="letter, cloze or both."),
        Option("evaluate.gate.max_drift", ("--max-drift",)),
        Option("evaluate.gate.max_kl", ("--max-kl",)),
        Option("evaluate.gate.max_flip_rate", ("--max-flip-rate",)),
        Option("quantize.overwrite", ("--overwrite",), also=("calibration.overwrite",)),
        Option(
            "quantize.seed",
            ("--seed",),
            also=("quantize.sensitivity.seed", "calibration.seed", "evaluate.seed"),
        ),
    ],
    "build",
    build=_linked,
)


@app.command(help="calibrate → quantize → evaluate with a gate, in one command for CI.")
@BUILD.command
def build(ctx: typer.Context, **values: Any) -> None:
    from qpack.build import run_build

    out = output(ctx)
    config = run(out, lambda: BUILD.config(values))
    built = run(out, lambda: BUILD.translated(lambda: run_build(config, out.progress())))
    summary = built.to_json()
    out.result(
        summary, build_table(summary, built.quantized.manifest), *eval_tables(built.evaluated.evaluation)
    )
    gate_exit(out, built.passed, built.evaluated.reasons)
