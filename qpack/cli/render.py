"""Rendering command results for a terminal: rich tables built from what the libraries return.

Each function takes the data a command got back (a manifest, an evaluation, a benchmark result) and
returns renderables; nothing here parses options or calls a library, so `--json` output and tables always show
the same data.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from qpack.console import kv_table

if TYPE_CHECKING:
    from evals.results import CacheUse, Evaluation, SequentialSummary

_SCHEME_STYLE = {
    "int4": "cyan",
    "int8": "green",
    "bf16": "yellow",
    "fp16": "yellow",
    "fp32": "red",
    "w8a8": "magenta",
}


def styled(label: str, short: bool = False) -> str:
    style = next((v for k, v in _SCHEME_STYLE.items() if label.startswith(k)), "white")
    if short:
        label = label.replace("int4-g", "i4g").replace("int8", "i8")
    return f"[{style}]{label}[/]"


# ---------------------------------------------------------------------------------------------- calibrate


def calibration_tables(manifest: dict[str, Any], output: Path, seconds: float) -> list[Any]:
    inputs, notes = _inputs_table(manifest)
    summary = kv_table("Calibration", _calibration_rows(manifest, output, seconds))
    return [inputs, *notes, _cleaning_table(manifest), summary]


def _inputs_table(manifest: dict[str, Any]) -> tuple[Table, list[str]]:
    inputs = Table(title="Inputs", title_justify="left")
    for column in ("file", "format", "field", "records", "malformed"):
        inputs.add_column(column, justify="right" if column in ("records", "malformed") else "left")
    notes: list[str] = []
    for item in manifest["inputs"]:
        name = Path(item["path"]).name
        field = str(item["field"] or "-")
        inputs.add_row(name, item["format"], field, f"{item['records']:,}", f"{item['malformed']:,}")
        notes.extend(f"[dim]{name}: {note}[/]" for note in item["notes"])
    return inputs, notes


def _cleaning_table(manifest: dict[str, Any]) -> Table:
    cleaning, sampling = manifest["cleaning"], manifest["sampling"]
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
        (f"  dropped: < {sampling['min_tokens']} tokens", cleaning["too_short"]),
        (f"  dropped: > {sampling['max_tokens']} tokens", cleaning["too_long"]),
        ("kept (sampling pool)", cleaning["kept"]),
    ):
        rules.add_row(label, f"{value:,}")
    return rules


def _calibration_rows(manifest: dict[str, Any], output: Path, seconds: float) -> list[tuple[str, Any]]:
    sampling = manifest["sampling"]
    train, heldout = manifest["lengths"]["train"], manifest["lengths"]["heldout"]
    rows: list[tuple[str, Any]] = [
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
        rows.append(
            (
                "coverage",
                f"{verdict}: token JS {coverage['token_js']:.3f}, length JS {coverage['length_js']:.3f}, "
                f"{coverage['token_coverage']:.1%} of production tokens seen",
            )
        )
    return [*rows, ("output", str(output)), ("time", f"{seconds:.1f} s")]


# ----------------------------------------------------------------------------------- quantize, inspect


def plan_table(plan: Any) -> Table:
    from quantize.planning.heatmap import plan_rows

    rows = plan_rows(plan)
    table = Table(title="Plan (decoder blocks x linears)", title_justify="left")
    columns = [c for c in rows[0] if c != "block"] if rows else []
    table.add_column("block", justify="right")
    for column in columns:
        table.add_column(column.replace("_proj", ""))
    for row in rows:
        table.add_row(str(row["block"]), *(styled(str(row[c]), short=True) for c in columns))
    return table


def plan_summary(plan: Any, info: dict[str, Any]) -> Table:
    counts: dict[str, int] = {}
    for scheme in plan.schemes.values():
        label = scheme.label() if scheme is not None else "fp32"
        counts[label] = counts.get(label, 0) + 1
    rows: list[tuple[str, Any]] = [
        ("plan", info.get("summary", "")),
        ("schemes", ", ".join(f"{styled(k)} {v}" for k, v in sorted(counts.items()))),
        ("avg bits (quantized linears)", f"{plan.bits():.3f} (scales and zero points included)"),
        ("planner", info.get("planner", "")),
    ]
    if info.get("predicted_kl") is not None:
        rows.append(("predicted KL (sum of per-layer)", f"{info['predicted_kl']:.5f}"))
    if "sensitivity_cache_hits" in info:
        rows.append(("sensitivity cache hits", info["sensitivity_cache_hits"]))
    return kv_table("Plan", rows)


def quality_rows(quality: dict[str, Any], size: dict[str, Any]) -> list[tuple[str, Any]]:
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
        *prompt_int8_rows(quality.get("prompt_int8")),
    ]


def prompt_int8_rows(measured: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The opt-in int8 prompt path's held-out cost (`--prefill-dtype int8`), where the manifest records it."""
    if not measured:
        return []
    return [
        (
            "with int8 prompt activations",
            f"KL {measured['kl']:.5f} (p95 {measured['kl_p95']:.4f}), top-1 {measured['top1_agreement']:.1%} "
            "(`--prefill-dtype int8`)",
        )
    ]


def artifact_table(manifest: dict[str, Any], output: Path, seconds: float) -> Table:
    timings = ", ".join(f"{k} {v:.0f}s" for k, v in manifest["timings_s"].items())
    rows = [
        ("artifact", f"{manifest['name']} v{manifest['version']}"),
        *quality_rows(manifest["quality"], manifest["size"]),
        ("time", f"{seconds:.1f} s ({timings})"),
        ("output", str(output)),
    ]
    if "export" in manifest:
        rows.append(("export", str(manifest["export"].get("path", ""))))
    return kv_table("Artifact", rows)


def inspect_table(manifest: dict[str, Any], plan: Any, verified: bool) -> Table:
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
        *quality_rows(manifest["quality"], manifest["size"]),
        (
            "files",
            f"{len(manifest.get('files', {}))} files, " + ("sha256 verified" if verified else "not verified"),
        ),
    ]
    for key, value in (manifest.get("evals") or {}).items():
        if isinstance(value, dict) and "summary" in value:
            rows.append((f"eval {key}", value["summary"]))
    return kv_table("Artifact", rows)


# ------------------------------------------------------------------------------------------- evaluate


def eval_tables(evaluation: Evaluation) -> list[Any]:
    return [_drift_table(evaluation), kv_table("Evaluation", _evaluation_rows(evaluation))]


def _drift_table(evaluation: Evaluation) -> Table:
    table = Table(
        title=f"MMLU {evaluation.mmlu.shots}-shot, {evaluation.mmlu.questions} questions",
        title_justify="left",
    )
    columns = (
        "format",
        "reference",
        "artifact",
        "drift pts [95% CI]",
        "flips",
        "R→W/W→R",
        "answer KL",
        "agree",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "format" else "right")
    for fmt, report in evaluation.formats.items():
        ref, cand = report.reference, report.candidate
        low, high = report.drift_ci95_points
        drift_style = "red" if high < 0 else "green" if low > 0 else "white"
        table.add_row(
            fmt,
            f"{ref.accuracy:.1%} ±{(ref.ci95[1] - ref.ci95[0]) / 2:.1%}",
            f"{cand.accuracy:.1%} ±{(cand.ci95[1] - cand.ci95[0]) / 2:.1%}",
            f"[{drift_style}]{report.drift_points:+.2f}[/] [{low:+.2f}, {high:+.2f}]",
            f"{report.flips.flip_rate:.1%}",
            f"{report.flips.right_to_wrong}/{report.flips.wrong_to_right}",
            f"{report.answer_kl.mean:.4f}",
            f"{report.top1_agreement:.1%}",
        )
    return table


def _evaluation_rows(evaluation: Evaluation) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [("reference", evaluation.reference.id)]
    heldout = evaluation.heldout
    if heldout:
        rows.append(
            (
                "held-out queries",
                f"KL {heldout.kl:.4f}, top-1 {heldout.top1_agreement:.1%}, "
                f"ppl {heldout.ppl:.2f} (reference {heldout.ppl_reference:.2f}), {heldout.tokens} tokens",
            )
        )
    elif evaluation.heldout_note:
        rows.append(("held-out queries", evaluation.heldout_note))
    rows.append(
        (
            "speed",
            ", ".join(
                f"{name.removeprefix('mmlu_').replace('_', ' ')} {v:.2f} questions/s"
                for name, v in evaluation.items_per_second.items()
            ),
        )
    )
    rows.append(("reference scores", _cache_line(evaluation.reference_cache)))
    if not evaluation.reference_loaded:
        rows.append(("reference model", "not loaded: every reference result came from the cache"))
    for fmt, report in evaluation.formats.items():
        if report.sequential is not None:
            rows.append((f"sequential gate ({fmt})", _sequential_line(report.sequential)))
    gate = evaluation.gate
    if gate.checked:
        verdict = "[green]passed[/]" if gate.passed else "[bold red]FAILED[/]: " + "; ".join(gate.reasons)
        rows.append(("gate", verdict))
    return rows


def _cache_line(caches: dict[str, CacheUse | None]) -> str:
    if all(cache is None for cache in caches.values()):
        return "computed (--no-cache)"
    return "; ".join(
        f"{fmt}: {cache.questions_from_cache} questions from cache {cache.path}"
        if cache
        else f"{fmt}: computed (--no-cache)"
        for fmt, cache in caches.items()
    )


def _sequential_line(sequential: SequentialSummary) -> str:
    low, high = sequential.drop_interval_points
    verdicts = ", ".join(
        f"{name} {d.verdict} after {d.questions} questions" for name, d in sequential.decisions.items()
    )
    return (
        f"{verdicts or 'undecided'}; drop in [{low:+.2f}, {high:+.2f}] pts at {sequential.confidence:.0%} "
        f"(anytime-valid); {sequential.stopped}; scored {sequential.scored}"
    )


def compare_table(result: dict[str, Any]) -> Table:
    questions = result["rows"][0]["questions"] if result["rows"] else 0
    table = Table(
        title=f"Against {result['reference']}: MMLU {result['format']} {result['shots']}-shot, {questions} questions",
        title_justify="left",
    )
    columns = (
        "artifact",
        "size",
        "avg bits",
        "decode b1",
        "prefill",
        "MMLU acc",
        "drift pts [95% CI]",
        "flips",
        "KL",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "artifact" else "right")
    for row in result["rows"]:
        speed = row["speed"] or {}
        low, high = row["drift_ci95_points"]
        kl = row["heldout_kl"] if row["heldout_kl"] is not None else row["answer_kl"]
        table.add_row(
            row["name"],
            f"{(row['bytes'] or 0) / 2**20:.1f} MiB",
            str(row["avg_bits"]),
            f"{speed['decode_tokens_per_s']:.1f} tok/s" if speed else "-",
            f"{speed['prefill_tokens_per_s']:.0f} tok/s" if speed else "-",
            f"{row['accuracy']:.1%} ±{(row['accuracy_ci95'][1] - row['accuracy_ci95'][0]) / 2:.1%}",
            f"{row['drift_points']:+.2f} [{low:+.2f}, {high:+.2f}]",
            f"{row['flip_rate']:.1%}",
            f"{kl:.4f}",
        )
    return table


def build_table(summary: dict[str, Any], manifest: dict[str, Any]) -> Table:
    rows = [
        ("artifact", f"{summary['name']} v{summary['version']} → {summary['artifact']}"),
        ("plan", summary["plan"]),
        *quality_rows(manifest["quality"], manifest["size"]),
        ("stages", ", ".join(f"{k} {v:.0f}s" for k, v in summary["stages_s"].items())),
    ]
    return kv_table("Build", rows)


# ---------------------------------------------------------------------------------------------- bench


def decode_tables(result: dict[str, Any], folder: Path) -> list[Any]:
    table = Table(title=f"Decode: {result['artifact']['name']} vs FP32 HF generate", title_justify="left")
    columns: tuple[str, ...] = (
        "batch",
        "prefill tok/s",
        "FP32 prefill",
        "decode tok/s",
        "FP32 decode",
        "ratio",
        "RSS MB",
        "FP32 RSS",
    )
    speculative = any("speculative_ratio" in row for row in result["rows"])
    if speculative:
        columns = (*columns, "no-spec decode", "spec ratio", "acceptance", "tok/step")
    for column in columns:
        table.add_column(column, justify="right")
    for row in result["rows"]:
        a, r = row["artifact"], row["reference"]
        cells = [
            str(row["batch"]),
            f"{a['prefill_tokens_per_s']:.0f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{a['decode_tokens_per_s']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{row['decode_ratio']:.2f}x",
            f"{a['peak_rss_mb']:.0f}",
            f"{r['peak_rss_mb']:.0f}",
        ]
        if speculative:
            cells += [
                f"{row['artifact_plain']['decode_tokens_per_s']:.1f}",
                f"{row['speculative_ratio']:.2f}x",
                f"{row['acceptance']:.2f}",
                f"{row['tokens_per_step']:.2f}",
            ]
        table.add_row(*cells)
    bound = result["bound"]
    fraction = bound["batch1_fraction_of_ceiling"]
    rows = [
        (
            "memory bound",
            f"{bound['artifact_bytes_per_token'] / 1e6:.0f} MB/token at {bound['bandwidth_gbs']:.1f} GB/s → "
            f"{bound['ceiling_tokens_per_s']:.0f} tok/s ceiling",
        ),
        ("batch 1 vs ceiling", "-" if fraction is None else f"{100 * fraction:.0f}%"),
        (
            "batch-1 step",
            ", ".join(f"{k} {v:.1f} ms" for k, v in result["profile_batch1"]["breakdown_ms"].items()),
        ),
        ("results", str(folder)),
    ]
    return [table, kv_table("Decode bound and profile", rows)]
