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
from quantize.errors import EXIT_GATE, EXIT_USAGE, QpackError

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


_SCHEME_STYLE = {
    "int4": "cyan",
    "int8": "green",
    "bf16": "yellow",
    "fp16": "yellow",
    "fp32": "red",
    "w8a8": "magenta",
}


def _styled(label: str, short: bool = False) -> str:
    style = next((v for k, v in _SCHEME_STYLE.items() if label.startswith(k)), "white")
    if short:
        label = label.replace("int4-g", "i4g").replace("int8", "i8")
    return f"[{style}]{label}[/]"


def _plan_table(plan: Any) -> Table:
    from quantize.report import plan_rows

    rows = plan_rows(plan)
    table = Table(title="Plan (decoder blocks x linears)", title_justify="left")
    columns = [c for c in rows[0] if c != "block"] if rows else []
    table.add_column("block", justify="right")
    for column in columns:
        table.add_column(column.replace("_proj", ""))
    for row in rows:
        table.add_row(str(row["block"]), *(_styled(str(row[c]), short=True) for c in columns))
    return table


def _plan_summary_rows(plan: Any, info: dict[str, Any]) -> list[tuple[str, Any]]:
    counts: dict[str, int] = {}
    for scheme in plan.schemes.values():
        label = scheme.label() if scheme is not None else "fp32"
        counts[label] = counts.get(label, 0) + 1
    rows: list[tuple[str, Any]] = [
        ("plan", info.get("summary", "")),
        ("schemes", ", ".join(f"{_styled(k)} {v}" for k, v in sorted(counts.items()))),
        ("avg bits (quantized linears)", f"{plan.bits():.3f} (scales and zero points included)"),
        ("planner", info.get("planner", "")),
    ]
    if info.get("predicted_kl") is not None:
        rows.append(("predicted KL (sum of per-layer)", f"{info['predicted_kl']:.5f}"))
    if "sensitivity_cache_hits" in info:
        rows.append(("sensitivity cache hits", info["sensitivity_cache_hits"]))
    return rows


def _quality_rows(quality: dict[str, Any], size: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (
            "size",
            f"{size['file_bytes'] / 2**20:.1f} MiB, {size['ratio_to_fp32']:.1%} of FP32 "
            f"({size['fp32_bytes'] / 2**20:.1f} MiB)",
        ),
        ("avg bits (quantized linears)", f"{size['avg_bits_quantized']:.3f}"),
        (
            "KL vs FP32 (held-out)",
            f"{quality['kl']:.5f} (p95 {quality['kl_p95']:.4f}, {quality['tokens']} tokens)",
        ),
        ("top-1 agreement", f"{quality['top1_agreement']:.1%}"),
        ("perplexity", f"{quality['ppl']:.2f} (FP32 {quality['ppl_reference']:.2f})"),
    ]


@app.command(help="Quantize a model with layer-wise mixed precision into a versioned artifact.")
def quantize(
    ctx: typer.Context,
    calibration: Path = typer.Option(
        ..., "--calibration", "-c", help="Calibration directory (qpack calibrate)."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="Artifact directory to write."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model (default: the calibration's model)."),
    name: str | None = typer.Option(None, "--name", help="Artifact name (default: model-preset)."),
    version: str = typer.Option("1", "--version", help="Artifact version."),
    preset: str = typer.Option("mixed", "--preset", "-p", help="mixed (default), int8, int4 or w8a8."),
    target_bits: float | None = typer.Option(
        None, "--target-bits", help="Average bits per quantized weight."
    ),
    max_kl: float | None = typer.Option(None, "--max-kl", help="Fewest bits with predicted KL under this."),
    schemes: list[str] = typer.Option([], "--scheme", help="Candidate schemes for the planner (repeatable)."),
    group_size: int = typer.Option(
        64, "--group-size", help="int4 group size for the int4 preset (32/64/128)."
    ),
    override: list[str] = typer.Option([], "--override", help="PATTERN=SCHEME, e.g. 're:.*down_proj=int8'."),
    algorithm: str = typer.Option("auto", "--algorithm", help="auto, rtn, gptq, awq or smoothquant."),
    sensitivity: str = typer.Option("kl", "--sensitivity", help="kl (default), kl-all or mse."),
    sensitivity_tokens: int = typer.Option(
        256, "--sensitivity-tokens", help="Held-out tokens for sensitivity."
    ),
    calib_tokens: int = typer.Option(4096, "--calib-tokens", help="Calibration tokens for GPTQ/AWQ."),
    eval_tokens: int = typer.Option(
        2048, "--eval-tokens", help="Held-out tokens for the final KL/PPL check."
    ),
    act_order: bool = typer.Option(True, "--act-order/--no-act-order", help="GPTQ activation order."),
    damp: float = typer.Option(0.01, "--damp", help="GPTQ damping (fraction of mean Hessian diagonal)."),
    smoothquant_alpha: float = typer.Option(
        0.5, "--smoothquant-alpha", help="SmoothQuant migration strength."
    ),
    export: str | None = typer.Option(None, "--export", help="Also export: compressed-tensors."),
    seed: int = typer.Option(0, "--seed", help="Seed for token sampling."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing artifact."),
) -> None:
    from quantize.algorithms import GPTQConfig
    from quantize.pipeline import QuantizeConfig, quantize_model
    from quantize.sensitivity import SensitivityConfig

    out = _out(ctx)
    config = QuantizeConfig(
        output=output,
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
        sensitivity=SensitivityConfig(method=sensitivity, num_tokens=sensitivity_tokens, seed=seed),
        calib_tokens=calib_tokens,
        eval_tokens=eval_tokens,
        export=export,
        overwrite=overwrite,
        seed=seed,
    )

    def on_plan(plan: Any, info: dict[str, Any]) -> None:
        if not out.quiet and not out.json_mode:
            out.stderr.print(_plan_table(plan))
            out.stderr.print(kv_table("Plan", _plan_summary_rows(plan, info)))

    result = _run(out, lambda: quantize_model(config, out.progress(), on_plan))
    for warning in result.warnings:
        out.warn(warning)
    manifest = result.manifest
    rows = [
        ("artifact", f"{manifest['name']} v{manifest['version']}"),
        *_quality_rows(manifest["quality"], manifest["size"]),
        (
            "time",
            f"{result.seconds:.1f} s ({', '.join(f'{k} {v:.0f}s' for k, v in manifest['timings_s'].items())})",
        ),
        ("output", str(result.output)),
    ]
    if "export" in manifest:
        rows.append(("export", str(manifest["export"].get("path", ""))))
    out.result(
        {"ok": True, "output": str(result.output), "seconds": round(result.seconds, 2), "manifest": manifest},
        kv_table("Artifact", rows),
    )


@app.command(help="Print an artifact's manifest: plan, sizes, quality, evals; verify its hashes.")
def inspect(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check every file's sha256."),
) -> None:
    from quantize.artifact import read_manifest, verify_artifact
    from quantize.plan import Plan

    out = _out(ctx)

    def load() -> dict[str, Any]:
        manifest = read_manifest(artifact)
        if verify:
            verify_artifact(artifact, manifest)
        return manifest

    manifest = _run(out, load)
    plan = Plan.from_json(manifest["modules"])
    source = manifest.get("source", {})
    calibration = manifest.get("calibration", {})
    rows: list[tuple[str, Any]] = [
        (
            "artifact",
            f"{manifest.get('name')} v{manifest.get('version')} (format {manifest.get('format_version')})",
        ),
        ("created", f"{manifest.get('created_at')} by qpack {manifest.get('qpack_version')}"),
        (
            "source",
            f"{source.get('model_id')} ({source.get('architecture')}, weights {str(source.get('weights_sha256'))[:12]})",
        ),
        (
            "calibration",
            f"{calibration.get('train_sequences')} + {calibration.get('heldout_sequences')} held-out sequences "
            f"(manifest {str(calibration.get('manifest_sha256'))[:12]})",
        ),
        ("plan", manifest.get("quantization", {}).get("summary", plan.summary())),
        *_quality_rows(manifest["quality"], manifest["size"]),
        (
            "files",
            f"{len(manifest.get('files', {}))} files, " + ("sha256 verified" if verify else "not verified"),
        ),
    ]
    for key, value in (manifest.get("evals") or {}).items():
        if isinstance(value, dict) and "summary" in value:
            rows.append((f"eval {key}", value["summary"]))
    out.result(manifest, _plan_table(plan), kv_table("Artifact", rows))


def _formats(value: str) -> tuple[str, ...]:
    return ("letter", "cloze") if value == "both" else (value,)


def _eval_tables(result: dict[str, Any]) -> list[Any]:
    table = Table(
        title=f"MMLU {result['mmlu']['shots']}-shot, {result['mmlu']['questions']} questions",
        title_justify="left",
    )
    for column in (
        "format",
        "reference",
        "artifact",
        "drift pts [95% CI]",
        "flips",
        "R→W/W→R",
        "answer KL",
        "agree",
    ):
        table.add_column(column, justify="left" if column == "format" else "right")
    for fmt, report in result["formats"].items():
        ref, cand = report["reference"], report["candidate"]
        low, high = report["drift_ci95_points"]
        drift_style = "red" if high < 0 else "green" if low > 0 else "white"
        table.add_row(
            fmt,
            f"{ref['accuracy']:.1%} ±{(ref['ci95'][1] - ref['ci95'][0]) / 2:.1%}",
            f"{cand['accuracy']:.1%} ±{(cand['ci95'][1] - cand['ci95'][0]) / 2:.1%}",
            f"[{drift_style}]{report['drift_points']:+.2f}[/] [{low:+.2f}, {high:+.2f}]",
            f"{report['flips']['flip_rate']:.1%}",
            f"{report['flips']['right_to_wrong']}/{report['flips']['wrong_to_right']}",
            f"{report['answer_kl']['mean']:.4f}",
            f"{report['top1_agreement']:.1%}",
        )
    rows: list[tuple[str, Any]] = [("reference", result["reference"]["id"])]
    heldout = result.get("heldout")
    if heldout:
        rows.append(
            (
                "held-out queries",
                f"KL {heldout['kl']:.4f}, top-1 {heldout['top1_agreement']:.1%}, "
                f"ppl {heldout['ppl']:.2f} (reference {heldout['ppl_reference']:.2f}), {heldout['tokens']} tokens",
            )
        )
    elif result.get("heldout_note"):
        rows.append(("held-out queries", result["heldout_note"]))
    rows.append(
        ("speed", ", ".join(f"{fmt} {v:.2f} items/s" for fmt, v in result["items_per_second"].items()))
    )
    gate = result["gate"]
    if gate["checked"]:
        rows.append(
            (
                "gate",
                "[green]passed[/]"
                if gate["passed"]
                else "[bold red]FAILED[/]: " + "; ".join(gate["reasons"]),
            )
        )
    return [table, kv_table("Evaluation", rows)]


def _gate_exit(out: Output, passed: bool, reasons: list[str]) -> None:
    if not passed:
        out.stderr.print(f"[bold red]gate failed:[/] {'; '.join(reasons)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_GATE)


@app.command(help="Measure MMLU drift of an artifact against its reference; gate CI on it.")
def evaluate(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    reference: str | None = typer.Option(
        None, "--reference", "-r", help="Reference model or artifact (default: source)."
    ),
    mmlu: Path | None = typer.Option(None, "--mmlu", help="MMLU directory (hendrycks or cais layout)."),
    subjects: str | None = typer.Option(None, "--subjects", help="Comma-separated subset of subjects."),
    limit: int | None = typer.Option(None, "--limit", help="At most N questions per subject (stratified)."),
    shots: int = typer.Option(5, "--shots", help="Few-shot examples from the dev split (0-5)."),
    fmt: str = typer.Option("letter", "--format", help="letter, cloze or both."),
    calibration: Path | None = typer.Option(
        None, "--calibration", help="Calibration dir for held-out PPL/KL."
    ),
    heldout_tokens: int = typer.Option(2048, "--heldout-tokens", help="Held-out tokens for PPL/KL."),
    max_drift: float | None = typer.Option(None, "--max-drift", help="Fail if accuracy drops more (points)."),
    max_kl: float | None = typer.Option(None, "--max-kl", help="Fail if held-out next-token KL is higher."),
    max_flip_rate: float | None = typer.Option(
        None, "--max-flip-rate", help="Fail if more answers flip (0-1)."
    ),
    batch_tokens: int = typer.Option(4096, "--batch-tokens", help="Tokens per scoring batch."),
    write: bool = typer.Option(True, "--write/--no-write", help="Write results into the artifact."),
    seed: int = typer.Option(0, "--seed", help="Seed for --limit sampling and bootstrap."),
) -> None:
    from evals.evaluate import EvaluateConfig, Gate
    from evals.evaluate import evaluate as run_evaluate

    out = _out(ctx)
    config = EvaluateConfig(
        artifact=artifact,
        reference=reference,
        mmlu=mmlu,
        subjects=subjects,
        limit=limit,
        shots=shots,
        formats=_formats(fmt),
        calibration=calibration,
        heldout_tokens=heldout_tokens,
        gate=Gate(max_drift=max_drift, max_kl=max_kl, max_flip_rate=max_flip_rate),
        write=write,
        token_budget=batch_tokens,
        seed=seed,
    )
    evaluated = _run(out, lambda: run_evaluate(config, out.progress()))
    data = {
        "ok": evaluated.passed,
        **{k: v for k, v in evaluated.result.items() if k != "formats"},
        "formats": {
            f: {k: v for k, v in r.items() if k != "kl_values"}
            for f, r in evaluated.result["formats"].items()
        },
        "report_dir": str(evaluated.report_dir) if evaluated.report_dir else None,
    }
    out.result(data, *_eval_tables(evaluated.result))
    _gate_exit(out, evaluated.passed, evaluated.reasons)


@app.command(help="Serve an artifact with continuous batching over a paged KV cache (OpenAI API).")
def serve(
    ctx: typer.Context,
    target: str = typer.Argument(
        ..., help="Artifact directory, or a model (HF folder, .gguf, Hub id, alias)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default loopback only)."),
    port: int = typer.Option(8000, "--port", help="Port."),
    kv_memory: str = typer.Option(
        "512MB", "--kv-memory", help="KV pool size: bytes (512MB, 2GiB) or a fraction of free memory."
    ),
    block_size: int = typer.Option(
        8, "--block-size", help="Tokens per KV block (smaller: less of the pool left unfilled)."
    ),
    kv_dtype: str = typer.Option(
        "float32", "--kv-dtype", help="KV pool element type: float32, bfloat16 (half the memory) or float16."
    ),
    max_num_batched_tokens: int = typer.Option(
        1024, "--max-num-batched-tokens", help="Token budget per step."
    ),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", help="Sequences per batch."),
    max_queue: int = typer.Option(256, "--max-queue", help="Waiting requests before 429."),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Context limit (default: the model's)."
    ),
    request_timeout: float = typer.Option(
        600.0, "--request-timeout", help="Seconds before a request is aborted."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="QPACK_API_KEY", help="Require 'Authorization: Bearer KEY'."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="For plain models: float32, bfloat16 or float16."),
    prefix_caching: bool = typer.Option(
        True, "--prefix-caching/--no-prefix-caching", help="Share cached prompt prefixes."
    ),
    compile_decode: bool = typer.Option(
        False,
        "--compile",
        help="torch.compile the decode steps the fused native step doesn't cover (over 16 sequences, layers "
        "it can't run, no native kernels); minutes of warm-up at start.",
    ),
) -> None:
    from serve.api import ServerInfo
    from serve.engine import KV_DTYPES, EngineConfig
    from serve.server import build_engine, describe, load_for_serving, serve_forever

    out = _out(ctx)
    problems = [
        message
        for ok, message in (
            (block_size >= 1, "--block-size must be at least 1"),
            (max_num_batched_tokens >= 1, "--max-num-batched-tokens must be at least 1"),
            (max_num_seqs >= 1, "--max-num-seqs must be at least 1"),
            (max_queue >= 0, "--max-queue must be >= 0"),
            (request_timeout > 0, "--request-timeout must be > 0"),
            (1 <= port <= 65535, "--port must be 1..65535"),
            (kv_dtype in KV_DTYPES, f"--kv-dtype must be one of {', '.join(KV_DTYPES)} (got {kv_dtype!r})"),
        )
        if not ok
    ]
    if problems:
        out.error("invalid serve options: " + "; ".join(problems), EXIT_USAGE)
        raise typer.Exit(EXIT_USAGE)
    loaded = _run(out, lambda: load_for_serving(target, dtype))
    config = EngineConfig(
        block_size=block_size,
        kv_memory=kv_memory,
        kv_dtype=KV_DTYPES[kv_dtype],
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_queue=max_queue,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        compile=compile_decode,
    )
    if not out.quiet:
        out.stderr.print(
            "loading the native decode kernels (built once per machine: ~1 min the first time)...",
            highlight=False,
        )
    engine = _run(out, lambda: build_engine(loaded, config))
    if compile_decode:
        if not out.quiet:
            out.stderr.print("compiling the decode step (torch.compile)...", highlight=False)
        engine.warmup()
    if not out.quiet:
        out.stderr.print(
            f"[bold]qpack serve[/] {loaded.name} v{loaded.version} ({loaded.source})", highlight=False
        )
        out.stderr.print(describe(engine), highlight=False)
        out.stderr.print(
            f"listening on http://{host}:{port} (OpenAI API under /v1; /health, /metrics)", highlight=False
        )
        if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            out.warn(f"binding {host} without --api-key: anyone who can reach this port can use the model")
    serve_forever(engine, ServerInfo(loaded.name, loaded.version, api_key, request_timeout), host, port)


bench_app = typer.Typer(
    help="Speed, memory and load benchmarks against a baseline measured in the same run.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise QpackError(f"{option} must be comma-separated integers (got {text!r})") from None
    if not values or any(v < 1 for v in values):
        raise QpackError(f"{option} must list positive integers (got {text!r})")
    return values


@bench_app.command("decode", help="Prefill/decode tokens/s and peak RSS of an artifact vs FP32 HF generate.")
def bench_decode(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    reference: str | None = typer.Option(
        None, "--reference", help="Reference model (default: the artifact's source)."
    ),
    batches: str = typer.Option("1,4,16,32", "--batches", help="Batch sizes."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Prompt length."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens generated per sequence."),
    repeats: int = typer.Option(3, "--repeats", help="Alternating runs per batch size (median reported)."),
    compile_decode: bool = typer.Option(
        False,
        "--compile",
        help="Run the artifact with its torch.compile'd decode step (as `serve --compile`).",
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Results folder (default bench-results/decode-TIME)."
    ),
) -> None:
    from quantize.artifact import read_manifest
    from serve.bench.decode import DecodeConfig, run_decode_bench
    from serve.bench.report import decode_markdown, decode_plots, results_dir, write_results

    out = _out(ctx)

    def run() -> tuple[dict[str, Any], Path]:
        read_manifest(artifact)
        config = DecodeConfig(
            artifact,
            reference,
            _ints(batches, "--batches"),
            prompt_tokens,
            new_tokens,
            repeats,
            compile=compile_decode,
        )
        result = run_decode_bench(config)
        folder = results_dir(out_dir, "decode")
        write_results(folder, result, decode_markdown(result), decode_plots(result, folder))
        return result, folder

    result, folder = _run(out, run)
    table = Table(title=f"Decode: {result['artifact']['name']} vs FP32 HF generate", title_justify="left")
    for column in (
        "batch",
        "prefill tok/s",
        "FP32 prefill",
        "decode tok/s",
        "FP32 decode",
        "ratio",
        "RSS MB",
        "FP32 RSS",
    ):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        a, r = row["artifact"], row["reference"]
        table.add_row(
            str(row["batch"]),
            f"{a['prefill_tokens_per_s']:.0f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{a['decode_tokens_per_s']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{row['decode_ratio']:.2f}x",
            f"{a['peak_rss_mb']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
        )
    bound = result["bound"]
    rows = [
        (
            "memory bound",
            f"{bound['artifact_bytes_per_token'] / 1e6:.0f} MB/token at {bound['bandwidth_gbs']:.1f} GB/s → {bound['ceiling_tokens_per_s']:.0f} tok/s ceiling",
        ),
        (
            "batch 1 vs ceiling",
            "-"
            if bound["batch1_fraction_of_ceiling"] is None
            else f"{100 * bound['batch1_fraction_of_ceiling']:.0f}%",
        ),
        (
            "batch-1 step",
            ", ".join(f"{k} {v:.1f} ms" for k, v in result["profile_batch1"]["breakdown_ms"].items()),
        ),
        ("results", str(folder)),
    ]
    out.result({**result, "folder": str(folder)}, table, kv_table("Decode bound and profile", rows))


@bench_app.command(
    "serve", help="Replay ShareGPT traffic against qpack serve and a naive HF server, same run."
)
def bench_serve(
    ctx: typer.Context,
    artifact: Path | None = typer.Argument(None, help="Artifact to serve (omit with --url)."),
    url: str | None = typer.Option(None, "--url", help="Benchmark an already running server instead."),
    baseline: str = typer.Option(
        "naive", "--baseline", help="naive (HF generate, one at a time, FP32) or none."
    ),
    baseline_model: str | None = typer.Option(None, "--baseline-model", help="Model for the naive baseline."),
    concurrency: str = typer.Option("10,30,50", "--concurrency", help="Concurrency levels."),
    rate: list[float] = typer.Option(
        [], "--rate", help="Poisson arrival rates (req/s), instead of or besides levels."
    ),
    requests: int | None = typer.Option(None, "--requests", help="Requests per level (default: the level)."),
    max_output_tokens: int = typer.Option(
        128, "--max-output-tokens", help="Cap on output tokens per request."
    ),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", help="Skip longer prompts."),
    max_seconds: float = typer.Option(900.0, "--max-seconds", help="Time limit per level and server."),
    abort_fraction: float = typer.Option(
        0.0, "--abort-fraction", help="Share of requests the client aborts mid-stream."
    ),
    kv_memory: str = typer.Option("512MB", "--kv-memory", help="KV pool of the qpack server."),
    server_arg: list[str] = typer.Option(
        [], "--server-arg", help="Extra `qpack serve` option, repeatable (--server-arg=--kv-dtype=bfloat16)."
    ),
    seed: int = typer.Option(0, "--seed", help="Request sampling seed."),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Results folder (default bench-results/serve-TIME)."
    ),
) -> None:
    from serve.bench.report import results_dir, serve_markdown, serve_plots, write_results
    from serve.bench.serving import ServeBenchConfig, run_serve_bench

    out = _out(ctx)

    def run() -> tuple[dict[str, Any], Path]:
        if baseline not in ("naive", "none"):
            raise QpackError(f"--baseline must be naive or none (got {baseline!r})")
        if artifact is None and url is None:
            raise QpackError("give an artifact directory to serve, or --url of a running qpack server")
        if url is not None and not url.startswith(("http://127.", "http://localhost", "http://[::1]")):
            raise QpackError(
                f"--url {url} is not a loopback address; the load generator only targets this machine"
            )
        config = ServeBenchConfig(
            artifact=artifact,
            url=url,
            baseline=baseline,
            baseline_model=baseline_model,
            levels=_ints(concurrency, "--concurrency") if concurrency else (),
            rates=tuple(rate),
            requests_per_level=requests,
            max_prompt_tokens=max_prompt_tokens,
            max_output_tokens=max_output_tokens,
            max_seconds=max_seconds,
            abort_fraction=abort_fraction,
            seed=seed,
            kv_memory=kv_memory,
            extra_server_args=tuple(server_arg),
        )
        log = (lambda m: None) if out.quiet else (lambda m: out.stderr.print(m, highlight=False))
        result = run_serve_bench(config, log)
        folder = results_dir(out_dir, "serve")
        write_results(folder, result, serve_markdown(result), serve_plots(result, folder))
        return result, folder

    result, folder = _run(out, run)
    from rich.markdown import Markdown

    out.result({**result, "folder": str(folder)}, Markdown(serve_markdown(result)), f"results: {folder}")


@app.command(help="calibrate → quantize → evaluate with a gate, in one command for CI.")
def build(
    ctx: typer.Context,
    output: Path = typer.Option(..., "--output", "-o", help="Artifact directory to write."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model (default smollm2-135m)."),
    queries: list[Path] = typer.Option([], "--queries", help="User query files (default: bundled ShareGPT)."),
    calibration: Path | None = typer.Option(None, "--calibration", help="Reuse this calibration directory."),
    num_samples: int = typer.Option(512, "--num-samples", "-n", help="Calibration samples."),
    preset: str = typer.Option("mixed", "--preset", "-p", help="mixed, int8, int4 or w8a8."),
    target_bits: float | None = typer.Option(
        None, "--target-bits", help="Average bits per quantized weight."
    ),
    override: list[str] = typer.Option([], "--override", help="PATTERN=SCHEME (repeatable)."),
    name: str | None = typer.Option(None, "--name", help="Artifact name."),
    version: str = typer.Option("1", "--version", help="Artifact version."),
    mmlu: Path | None = typer.Option(None, "--mmlu", help="MMLU directory."),
    subjects: str | None = typer.Option(None, "--subjects", help="Comma-separated MMLU subjects."),
    limit: int | None = typer.Option(5, "--limit", help="MMLU questions per subject (0 = all)."),
    shots: int = typer.Option(5, "--shots", help="MMLU few-shot examples."),
    fmt: str = typer.Option("letter", "--format", help="letter, cloze or both."),
    max_drift: float | None = typer.Option(None, "--max-drift", help="Gate: max accuracy drop (points)."),
    max_kl: float | None = typer.Option(None, "--max-kl", help="Gate: max held-out next-token KL."),
    max_flip_rate: float | None = typer.Option(
        None, "--max-flip-rate", help="Gate: max share of flipped answers."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing outputs."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling."),
) -> None:
    from evals.build import BuildConfig, run_build
    from evals.evaluate import Gate

    out = _out(ctx)
    config = BuildConfig(
        output=output,
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
        formats=_formats(fmt),
        gate=Gate(max_drift=max_drift, max_kl=max_kl, max_flip_rate=max_flip_rate),
        overwrite=overwrite,
        seed=seed,
    )
    built = _run(out, lambda: run_build(config, out.progress()))
    summary = built.summary
    rows = [
        ("artifact", f"{summary['name']} v{summary['version']} → {summary['artifact']}"),
        ("plan", summary["plan"]),
        *_quality_rows(built.quantized.manifest["quality"], built.quantized.manifest["size"]),
        ("stages", ", ".join(f"{k} {v:.0f}s" for k, v in summary["stages_s"].items())),
    ]
    out.result(summary, kv_table("Build", rows), *_eval_tables(built.evaluated.result))
    _gate_exit(out, built.evaluated.passed, built.evaluated.reasons)


def main() -> None:
    from quantize.memory import release_freed_memory

    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command != "serve":  # a server reuses same-size buffers every step: see quantize/memory.py
        release_freed_memory()
    try:
        app()
    except SystemExit:
        raise
    except BrokenPipeError:  # pragma: no cover - `qpack ... | head`
        sys.exit(0)


if __name__ == "__main__":
    main()
