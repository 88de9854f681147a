"""The `qpack` command line: parse options, call one library function, render the result.

It lives in `evals` because evals is the top of the pipeline: it is the one package allowed to depend on all
the others (`qpack build` chains calibrate → quantize → evaluate), so the CLI adds no new dependency edge.
Heavy imports (torch, transformers) happen inside the commands, so `qpack --help` stays instant.

Exit codes: 0 ok, 1 a quality gate failed, 2 bad input or usage.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.table import Table

from evals.console import Output, kv_table
from quantize import __version__
from quantize.errors import EXIT_USAGE, QpackError

T = TypeVar("T")

app = typer.Typer(
    name="qpack",
    help="Turn a Hugging Face causal LM into a smaller, faster, measured artifact, and serve it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qpack {__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    ctx: typer.Context,
    json_output: bool = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    ctx.obj = Output(json_mode=json_output, quiet=quiet)


def _out(ctx: typer.Context) -> Output:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Output) else Output()


def _run(out: Output, call: Callable[[], T]) -> T:
    """Run a library call; a `QpackError` becomes its one-line message and exit code."""
    try:
        return call()
    except QpackError as exc:
        out.error(exc.message, exc.exit_code)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        out.error("interrupted; nothing was written", 130)
        raise typer.Exit(130) from None


def _not_built(ctx: typer.Context, name: str) -> None:
    out = _out(ctx)
    out.error(f"`qpack {name}` is not built yet in qpack {__version__}", EXIT_USAGE)
    raise typer.Exit(EXIT_USAGE)


# ---------------------------------------------------------------------------------------------- calibrate


def _calibration_tables(manifest: dict[str, Any], output: Path, seconds: float) -> list[Any]:
    inputs = Table(title="Inputs", title_justify="left")
    for column in ("file", "format", "field", "records", "malformed"):
        inputs.add_column(column, justify="right" if column in ("records", "malformed") else "left")
    notes: list[str] = []
    for item in manifest["inputs"]:
        inputs.add_row(
            Path(item["path"]).name,
            item["format"],
            str(item["field"] or "-"),
            f"{item['records']:,}",
            f"{item['malformed']:,}",
        )
        notes.extend(f"[dim]{Path(item['path']).name}: {note}[/]" for note in item["notes"])
    cleaning = manifest["cleaning"]
    rules = Table(title="Cleaning (in order)", title_justify="left")
    rules.add_column("step")
    rules.add_column("count", justify="right")
    for label, value in (
        ("conversations read", cleaning["conversations"]),
        ("  without a usable user turn", cleaning["no_user_turn"]),
        (f"samples ({manifest['extraction']['turns']} user turn)", cleaning["samples"]),
        ("  whitespace stripped", cleaning["stripped"]),
        ("  dropped: empty", cleaning["empty"]),
        ("  dropped: exact duplicates", cleaning["exact_duplicates"]),
        ("  dropped: normalised duplicates", cleaning["normalized_duplicates"]),
        ("  PII scrubbed (samples)", cleaning["pii_samples"]),
        *((f"    {kind.replace('_', ' ')} replaced", count) for kind, count in cleaning["pii"].items()),
        ("  dropped: template rejected", manifest["extraction"]["template_rejected"]),
        (f"  dropped: < {manifest['sampling']['min_tokens']} tokens", cleaning["too_short"]),
        (f"  dropped: > {manifest['sampling']['max_tokens']} tokens", cleaning["too_long"]),
        ("kept (sampling pool)", cleaning["kept"]),
    ):
        rules.add_row(label, f"{value:,}")
    sampling = manifest["sampling"]
    lengths = manifest["lengths"]
    train, heldout = lengths["train"], lengths["heldout"]
    summary_rows: list[tuple[str, Any]] = [
        ("model", f"{manifest['model']['id']} ({manifest['model']['architecture']})"),
        ("chat template", "yes" if manifest["extraction"]["chat_template"] else "no"),
        (
            "sampled",
            f"{sampling['train']} calibration + {sampling['heldout']} held-out of {sampling['pool']:,} "
            f"(seed {sampling['seed']}, stratified by length)",
        ),
        (
            "tokens",
            f"calibration {train['total_tokens']:,} (p50 {train.get('p50', 0)}, p90 {train.get('p90', 0)}, "
            f"max {train.get('max', 0)}); held-out {heldout['total_tokens']:,}",
        ),
        ("activation stats", f"{manifest['stats']['num_linear']} linear layers"),
    ]
    coverage = manifest.get("coverage")
    if coverage:
        verdict = (
            "[green]covers production[/]" if coverage["covered"] else "[bold red]DOES NOT cover production[/]"
        )
        summary_rows.append(
            (
                "coverage",
                f"{verdict}: token JS {coverage['token_js']:.3f}, length JS {coverage['length_js']:.3f}, "
                f"{coverage['token_coverage']:.1%} of production tokens seen",
            )
        )
    summary_rows += [("output", str(output)), ("time", f"{seconds:.1f} s")]
    return [inputs, *notes, rules, kv_table("Calibration", summary_rows)]


@app.command(help="Clean, scrub and sample real user queries; record activation statistics.")
def calibrate(
    ctx: typer.Context,
    output: Path = typer.Option(
        Path("calibration"), "--output", "-o", help="Calibration directory to write."
    ),
    model: str = typer.Option(
        "smollm2-135m", "--model", "-m", help="HF folder, .gguf file, Hub id, or alias (smollm2-135m)."
    ),
    queries: list[Path] = typer.Option(
        [], "--queries", help="Query file(s): JSONL, JSON, CSV, TSV, TXT, Parquet or a saved datasets folder."
    ),
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
    num_samples: int = typer.Option(
        512, "--num-samples", "-n", help="Samples to keep (calibration + held-out)."
    ),
    heldout: float = typer.Option(
        0.1, "--heldout", help="Fraction of the samples held out for PPL/KL checks."
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    reference: list[Path] = typer.Option(
        [], "--reference", help="A sample of production traffic to check coverage against."
    ),
    max_token_js: float = typer.Option(0.45, "--max-token-js", help="Coverage warning: token JS above this."),
    max_length_js: float = typer.Option(
        0.25, "--max-length-js", help="Coverage warning: length JS above this."
    ),
    keep_text: bool = typer.Option(False, "--keep-text", help="Also store the (scrubbed) query text."),
    batch_tokens: int = typer.Option(4096, "--batch-tokens", help="Padded tokens per forward batch."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
) -> None:
    from calibrate import CalibrationConfig, run_calibration
    from calibrate.coverage import CoverageThresholds

    out = _out(ctx)
    config = CalibrationConfig(
        output=output,
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
    )
    result = _run(out, lambda: run_calibration(config, out.progress()))
    coverage = result.manifest.get("coverage")
    if coverage and not coverage["covered"]:
        for warning in coverage["warnings"]:
            out.warn(f"calibration set does not cover production traffic: {warning}")
    out.result(
        {
            "ok": True,
            "output": str(result.output),
            "seconds": round(result.seconds, 2),
            "manifest": result.manifest,
        },
        *_calibration_tables(result.manifest, result.output, result.seconds),
    )


# ------------------------------------------------------------------------------------- not yet built


@app.command(help="Quantize a model with layer-wise mixed precision into a versioned artifact.")
def quantize(ctx: typer.Context) -> None:
    _not_built(ctx, "quantize")


@app.command(help="Measure MMLU drift of an artifact against its reference; gate CI on it.")
def evaluate(ctx: typer.Context) -> None:
    _not_built(ctx, "evaluate")


@app.command(help="Serve an artifact with continuous batching over a paged KV cache (OpenAI API).")
def serve(ctx: typer.Context) -> None:
    _not_built(ctx, "serve")


@app.command(help="Speed, memory and load benchmarks against a baseline measured in the same run.")
def bench(ctx: typer.Context) -> None:
    _not_built(ctx, "bench")


@app.command(help="Print an artifact's manifest: plan, sizes, evals, hashes.")
def inspect(ctx: typer.Context) -> None:
    _not_built(ctx, "inspect")


@app.command(help="calibrate → quantize → evaluate with a gate, in one command for CI.")
def build(ctx: typer.Context) -> None:
    _not_built(ctx, "build")


def main() -> None:
    try:
        app()
    except SystemExit:
        raise
    except BrokenPipeError:  # pragma: no cover - `qpack ... | head`
        sys.exit(0)


if __name__ == "__main__":
    main()
