"""`qpack calibrate`: real user queries in, a calibration directory out.

The order matters and is fixed: read every source (counting what was broken), pick user turns, clean and
PII-scrub (nothing unscrubbed is ever stored), tokenize with the model's chat template, filter by length,
sample stratified by length with a held-out split, compare with production traffic when a reference is
given, then run the model once to record activation statistics. Output goes to a temp directory that is
renamed into place only when everything succeeded.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.clean import CleaningCounts, Sample, clean_samples, extract_samples
from calibrate.config import CalibrationConfig, CalibrationResult
from calibrate.coverage import compare
from calibrate.render import content_token_ids, has_chat_template, tokenize_samples
from calibrate.sample import stratified_split
from calibrate.sources import SourceReport, default_queries_path, read_source
from calibrate.stats import collect_stats
from quantize.common.config import ConfigError, Problem
from quantize.common.fileio import atomic_output_dir, check_output_dir, sha256_file, write_json
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.common.version import __version__
from quantize.io.calibration import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    STATS_FILE,
    TEXTS_FILE,
    TOKENS_FILE,
    pack_sequences,
    stats_to_tensors,
)
from quantize.model.sources import (
    ModelSource,
    load_tokenizer,
    resolve_model,
    tokenizer_sha256,
    weights_sha256,
)
from quantize.sequential.streamed import StreamedModel, check_memory


def _length_stats(lengths: list[int]) -> dict[str, Any]:
    if not lengths:
        return {"count": 0, "total_tokens": 0}
    ordered = sorted(lengths)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {
        "count": len(lengths),
        "total_tokens": sum(lengths),
        "min": ordered[0],
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": ordered[-1],
        "mean": round(statistics.fmean(lengths), 1),
    }


def _read_all(
    paths: tuple[str, ...], config: CalibrationConfig, counts: CleaningCounts, progress: Progress
) -> tuple[list[Sample], list[SourceReport]]:
    samples: list[Sample] = []
    reports: list[SourceReport] = []
    for raw in paths:
        with progress.task(f"Reading {Path(raw).name}"):
            data = read_source(Path(raw), config.format, config.field)
        reports.append(data.report)
        samples.extend(extract_samples(data.conversations, config.turns, Path(raw).name, counts))
    return samples, reports


def _prepare(
    paths: tuple[str, ...], config: CalibrationConfig, tokenizer: Any, use_template: bool, progress: Progress
) -> tuple[list[Sample], list[list[int]], CleaningCounts, list[SourceReport], int]:
    counts = CleaningCounts()
    samples, reports = _read_all(paths, config, counts, progress)
    samples = clean_samples(samples, counts)
    with progress.task("Tokenizing with the chat template" if use_template else "Tokenizing"):
        samples, token_ids, rejected = tokenize_samples(samples, tokenizer, use_template)
    kept_samples: list[Sample] = []
    kept_ids: list[list[int]] = []
    for sample, ids in zip(samples, token_ids, strict=True):
        if len(ids) < config.min_tokens:
            counts.too_short += 1
        elif len(ids) > config.max_tokens:
            counts.too_long += 1
        else:
            kept_samples.append(sample)
            kept_ids.append(ids)
    counts.kept = len(kept_samples)
    return kept_samples, kept_ids, counts, reports, rejected


@dataclass
class _Selection:
    """The cleaned sampling pool and the calibration / held-out split drawn from it."""

    samples: list[Sample]
    token_ids: list[list[int]]
    counts: CleaningCounts
    reports: list[SourceReport]
    rejected: int
    split: Any
    train_ids: list[list[int]]
    heldout_ids: list[list[int]]


def run_calibration(config: CalibrationConfig, progress: Progress = NULL_PROGRESS) -> CalibrationResult:
    """Build a calibration directory; raises `QpackError` on bad input, leaving nothing behind."""
    started = time.perf_counter()
    timings: dict[str, float] = {}
    output, queries = _check_inputs(config)

    phase = time.perf_counter()
    source: ModelSource = resolve_model(config.model, progress)
    tokenizer = load_tokenizer(source)
    use_template = config.chat_template and has_chat_template(tokenizer)
    timings["model_resolve"] = time.perf_counter() - phase

    phase = time.perf_counter()
    selection = _select(queries, config, tokenizer, use_template, progress)
    timings["read_clean_sample"] = time.perf_counter() - phase

    coverage: dict[str, Any] | None = None
    reference_reports: list[SourceReport] = []
    if config.reference:
        phase = time.perf_counter()
        coverage, reference_reports = _coverage(config, selection, tokenizer, use_template, progress)
        timings["coverage"] = time.perf_counter() - phase

    phase = time.perf_counter()
    streamed = StreamedModel(source.path)
    check_memory(streamed, sum(len(s) for s in selection.train_ids), config.max_memory)
    stats = collect_stats(streamed, selection.train_ids, config.token_budget, progress)
    del streamed
    timings["activation_stats"] = time.perf_counter() - phase

    manifest = _manifest(config, source, selection, use_template, coverage, reference_reports)
    manifest["stats"] = {"num_linear": len(stats), "num_tokens": sum(len(s) for s in selection.train_ids)}
    manifest["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    _write(output, config, selection, stats, manifest)
    return CalibrationResult(output=output, manifest=manifest, seconds=time.perf_counter() - started)


def _check_inputs(config: CalibrationConfig) -> tuple[Path, tuple[str, ...]]:
    """Options, the output directory and every input path, before any model is loaded."""
    config.validate()
    output = Path(config.output).expanduser().resolve()
    check_output_dir(output, config.overwrite, "calibration directory")
    queries = config.queries or (str(default_queries_path()),)
    missing = [
        Problem(field, f"file {raw} does not exist; check the path")
        for field, paths in (("queries", queries), ("reference", config.reference))
        for raw in paths
        if not Path(raw).expanduser().exists()
    ]
    if missing:
        raise ConfigError("CalibrationConfig", missing)
    return output, queries


def _select(
    queries: tuple[str, ...],
    config: CalibrationConfig,
    tokenizer: Any,
    use_template: bool,
    progress: Progress,
) -> _Selection:
    samples, token_ids, counts, reports, rejected = _prepare(
        queries, config, tokenizer, use_template, progress
    )
    if not samples:
        message = (
            f"were all filtered out ({counts.samples} samples: {counts.empty} empty, "
            f"{counts.exact_duplicates + counts.normalized_duplicates} duplicates, {counts.too_short} shorter than "
            f"`min_tokens` {config.min_tokens}, {counts.too_long} longer than `max_tokens` {config.max_tokens}); "
            "relax the length limits or check `field` and `turns`"
        )
        raise ConfigError("CalibrationConfig", [Problem("queries", message)])
    lengths = [len(ids) for ids in token_ids]
    split = stratified_split(lengths, config.num_samples, config.heldout_fraction, config.seed)
    train_ids = [token_ids[i] for i in split.train]
    heldout_ids = [token_ids[i] for i in split.heldout]
    return _Selection(samples, token_ids, counts, reports, rejected, split, train_ids, heldout_ids)


def _coverage(
    config: CalibrationConfig, selection: _Selection, tokenizer: Any, use_template: bool, progress: Progress
) -> tuple[dict[str, Any], list[SourceReport]]:
    """The calibration sample compared with the production reference (length and token distributions)."""
    ref_samples, ref_ids, _counts, reports, _ = _prepare(
        config.reference, config, tokenizer, use_template, progress
    )
    if not ref_samples:
        message = "queries were all filtered out; check them and `min_tokens`/`max_tokens`"
        raise ConfigError("CalibrationConfig", [Problem("reference", message)])
    train = selection.split.train
    coverage = compare(
        [len(selection.token_ids[i]) for i in train],
        content_token_ids([selection.samples[i] for i in train], tokenizer),
        [len(ids) for ids in ref_ids],
        content_token_ids(ref_samples, tokenizer),
        config.coverage,
    )
    return coverage, reports


def _manifest(
    config: CalibrationConfig,
    source: ModelSource,
    selection: _Selection,
    use_template: bool,
    coverage: dict[str, Any] | None,
    reference_reports: list[SourceReport],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "qpack_version": __version__,
        "model": {
            "id": source.model_id,
            "kind": source.kind,
            "model_type": source.model_type,
            "architecture": source.architecture,
            "weights_sha256": weights_sha256(source),
            "tokenizer_sha256": tokenizer_sha256(source),
        },
        "inputs": [r.to_json() for r in selection.reports],
        "extraction": {
            "turns": config.turns,
            "chat_template": use_template,
            "template_rejected": selection.rejected,
            "field": config.field,
        },
        "cleaning": selection.counts.to_json(),
        "sampling": {
            "strategy": "stratified by token length (power-of-two buckets), largest remainder",
            "num_samples": config.num_samples,
            "heldout_fraction": config.heldout_fraction,
            "seed": config.seed,
            "min_tokens": config.min_tokens,
            "max_tokens": config.max_tokens,
            "pool": len(selection.samples),
            "train": len(selection.train_ids),
            "heldout": len(selection.heldout_ids),
            "buckets": selection.split.buckets,
        },
        "lengths": {
            "train": _length_stats([len(s) for s in selection.train_ids]),
            "heldout": _length_stats([len(s) for s in selection.heldout_ids]),
        },
        "coverage": coverage,
        "reference_inputs": [r.to_json() for r in reference_reports],
        "keep_text": config.keep_text,
    }


def _write(
    output: Path, config: CalibrationConfig, selection: _Selection, stats: Any, manifest: dict[str, Any]
) -> None:
    """Tokens, activation statistics, optionally the scrubbed texts, and the manifest with every file's hash,
    into a temp directory renamed into place."""
    from safetensors.torch import save_file

    with atomic_output_dir(output, config.overwrite, "calibration directory") as tmp:
        tokens = {
            **pack_sequences(selection.train_ids, "train"),
            **pack_sequences(selection.heldout_ids, "heldout"),
        }
        save_file(tokens, str(tmp / TOKENS_FILE), metadata={"format": FORMAT})
        save_file(stats_to_tensors(stats), str(tmp / STATS_FILE), metadata={"format": FORMAT})
        files = [TOKENS_FILE, STATS_FILE]
        if config.keep_text:
            _write_texts(tmp / TEXTS_FILE, selection)
            files.append(TEXTS_FILE)
        manifest["files"] = {name: sha256_file(tmp / name) for name in files}
        write_json(tmp / MANIFEST_FILE, manifest)


def _write_texts(path: Path, selection: _Selection) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for split_name, indices in (("train", selection.split.train), ("heldout", selection.split.heldout)):
            for i in indices:
                messages = [{"role": m.role, "content": m.content} for m in selection.samples[i].messages]
                handle.write(json.dumps({"split": split_name, "messages": messages}, ensure_ascii=False))
                handle.write("\n")
