"""`qpack evaluate`: options -> `evals.pipeline.evaluate` -> drift tables and the gate's exit code.

`EvaluateConfig` names its problems by field; `named_by_flags` shows them under the flags of the command that
was typed (`qpack evaluate`, `build`, `compare`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import typer

from evals.config import EvaluateConfig, Gate
from qpack.cli import options as opt
from qpack.cli.app import app, formats, gate_exit, output, run
from qpack.cli.app import output as output_of
from qpack.cli.render import compare_table, eval_tables
from quantize.common.config import ConfigError

T = TypeVar("T")
_FLAGS = {"artifact": "ARTIFACT", "token_budget": "--batch-tokens", "formats": "--format"}


def evaluate_flag(field: str) -> str:
    """The command-line flag of an `EvaluateConfig` field (`gate.max_drift` -> `--max-drift`)."""
    name = field.removeprefix("gate.")
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def named_by_flags(what: str, call: Callable[[], T], config: type = EvaluateConfig) -> T:
    """`call()`, the problems of a `config` (`EvaluateConfig`, or `BuildConfig` with its fields) raised as
    "invalid {what}: --flag ..."."""
    try:
        return call()
    except ConfigError as error:
        if error.config != config.__name__:
            raise
        raise error.renamed(what, evaluate_flag) from None


@app.command(help="Measure MMLU drift of an artifact against its reference; gate CI on it.")
def evaluate(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    reference: opt.Reference = None,
    mmlu: opt.Mmlu = None,
    subjects: opt.Subjects = None,
    limit: opt.Limit = None,
    shots: opt.Shots = 5,
    fmt: opt.Format = "letter",
    calibration: Path | None = typer.Option(
        None, "--calibration", help="Calibration dir for held-out PPL/KL."
    ),
    heldout_tokens: int = typer.Option(2048, "--heldout-tokens", help="Held-out tokens for PPL/KL."),
    max_drift: opt.MaxDrift = None,
    max_kl: opt.MaxKL = None,
    max_flip_rate: opt.MaxFlipRate = None,
    batch_tokens: int = typer.Option(4096, "--batch-tokens", help="Tokens per scoring batch."),
    write: bool = typer.Option(True, "--write/--no-write", help="Write results into the artifact."),
    seed: int = typer.Option(0, "--seed", help="Seed for --limit sampling, question order and bootstrap."),
    cache: opt.Cache = True,
    sequential: bool = typer.Option(
        True,
        "--sequential/--all-questions",
        help="With --max-drift/--max-flip-rate and no --limit: stop once the gate is decided.",
    ),
    confidence: float = typer.Option(0.95, "--confidence", help="Confidence of the sequential gate."),
    max_questions: int | None = typer.Option(
        None,
        "--max-questions",
        help="Sequential: fail a gate still undecided after N questions (a time cap).",
    ),
    prefill_dtype: opt.PrefillDtype = "float32",
) -> None:
    from evals.pipeline import evaluate as run_evaluate

    out = output(ctx)
    config = EvaluateConfig(
        artifact=artifact,
        reference=reference,
        mmlu=mmlu,
        subjects=subjects,
        limit=limit,
        shots=shots,
        formats=formats(fmt),
        calibration=calibration,
        heldout_tokens=heldout_tokens,
        gate=Gate(max_drift=max_drift, max_kl=max_kl, max_flip_rate=max_flip_rate),
        write=write,
        token_budget=batch_tokens,
        seed=seed,
        cache=cache,
        sequential=sequential,
        confidence=confidence,
        max_questions=max_questions,
        prefill_dtype=prefill_dtype,
    )
    evaluated = run(
        out, lambda: named_by_flags("evaluate options", lambda: run_evaluate(config, out.progress()))
    )
    out.result(evaluated.to_json(), *eval_tables(evaluated.evaluation))
    gate_exit(out, evaluated.passed, evaluated.reasons)


@app.command(
    help="Several artifacts side by side against one reference: size, speed, MMLU, drift, flips, KL."
)
def compare(
    ctx: typer.Context,
    artifacts: list[Path] = typer.Argument(..., help="Artifact directories."),
    reference: opt.Reference = None,
    mmlu: opt.Mmlu = None,
    subjects: opt.Subjects = None,
    limit: opt.Limit = None,
    shots: opt.Shots = 5,
    fmt: str = typer.Option("letter", "--format", help="letter or cloze."),
    speed: bool = typer.Option(True, "--speed/--no-speed", help="Measure batch-1 prefill and decode speed."),
    cache: opt.Cache = True,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write PATH.md and PATH.json."),
    seed: int = typer.Option(0, "--seed", help="Seed for --limit sampling and bootstrap."),
) -> None:
    from qpack.compare import CompareConfig
    from qpack.compare import compare as run_compare

    out = output_of(ctx)
    config = CompareConfig(
        artifacts=tuple(artifacts),
        reference=reference,
        mmlu=mmlu,
        subjects=subjects,
        limit=limit,
        shots=shots,
        fmt=fmt,
        seed=seed,
        cache=cache,
        speed=speed,
        output=output,
    )
    result = run(out, lambda: named_by_flags("compare options", lambda: run_compare(config, out.progress())))
    out.result(result, compare_table(result))
