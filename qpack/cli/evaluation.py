"""`qpack evaluate` and `qpack compare`: options (built from `evals.EvaluateConfig` and `qpack.compare.CompareConfig`)
-> `evals.evaluate` / `qpack.compare.compare` -> drift tables and the gate's exit code."""

from __future__ import annotations

from typing import Any

import typer

from evals.config import EvaluateConfig
from qpack.cli.app import app, formats, gate_exit, output, run
from qpack.cli.fields import Option, Options
from qpack.cli.render import compare_table, eval_tables
from qpack.compare import CompareConfig

# What questions are scored, and against which reference: the same for one artifact and for several.
MMLU_OPTIONS: list[Option | str] = [
    Option("reference", ("--reference", "-r")),
    "mmlu",
    "subjects",
    "limit",
    "shots",
]

EVALUATE = Options(
    EvaluateConfig,
    [
        Option("artifact", argument=True),
        *MMLU_OPTIONS,
        Option("formats", ("--format",), str, "letter", formats, help="letter, cloze or both."),
        "calibration",
        "heldout_tokens",
        Option("gate.max_drift", ("--max-drift",)),
        Option("gate.max_kl", ("--max-kl",)),
        Option("gate.max_flip_rate", ("--max-flip-rate",)),
        Option("token_budget", ("--batch-tokens",)),
        Option("write", ("--write/--no-write",)),
        "seed",
        Option("cache", ("--cache/--no-cache",)),
        Option("sequential", ("--sequential/--all-questions",)),
        "confidence",
        "max_questions",
        "prefill_dtype",
    ],
    "evaluate",
)

COMPARE = Options(
    CompareConfig,
    [
        Option("artifacts", argument=True),
        *MMLU_OPTIONS,
        Option("fmt", ("--format",)),
        Option("speed", ("--speed/--no-speed",)),
        Option("cache", ("--cache/--no-cache",)),
        Option("output", ("--output", "-o")),
        "seed",
    ],
    "compare",
)


@app.command(help="Measure MMLU drift of an artifact against its reference; gate CI on it.")
@EVALUATE.command
def evaluate(ctx: typer.Context, **values: Any) -> None:
    from evals.pipeline import evaluate as run_evaluate

    out = output(ctx)
    config = run(out, lambda: EVALUATE.config(values))
    evaluated = run(out, lambda: EVALUATE.translated(lambda: run_evaluate(config, out.progress())))
    out.result(evaluated.to_json(), *eval_tables(evaluated.evaluation))
    gate_exit(out, evaluated.passed, evaluated.reasons)


@app.command(
    help="Several artifacts side by side against one reference: size, speed, MMLU, drift, flips, KL."
)
@COMPARE.command
def compare(ctx: typer.Context, **values: Any) -> None:
    from qpack.compare import compare as run_compare

    out = output(ctx)
    config = run(out, lambda: COMPARE.config(values))
    result = run(out, lambda: COMPARE.translated(lambda: run_compare(config, out.progress())))
    out.result(result, compare_table(result))
