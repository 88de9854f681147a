"""`qpack evaluate`: what quantization cost, measured on MMLU and on held-out user queries, with a CI gate.

The artifact is compared with its reference (by default the exact source model it was quantized from, checked
by weights hash; or any model or other artifact: `evals.reference`) on the same questions, in each requested
prompt format, and on the held-out calibration queries (perplexity of both, next-token KL). The results
(`evals.results`), with the sha256 of the eval data, go into the artifact: a fresh report folder
`ARTIFACT/evals/mmlu-<time>-<random>/` (Markdown, PNGs, mmlu.json) and the manifest's `evals` section and file
hashes, committed together by one atomic replacement of the manifest (`evals.store`), so an evaluation killed
at any point leaves the previous one in place. Gates then decide the exit code; results are written before a
gate fails the build, so a failing CI run still leaves its evidence.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from torch import nn

from evals.config import EvaluateConfig, Gate
from evals.mmlu import load_mmlu
from evals.paired import PairScoring, score_fixed, score_sequential
from evals.refcache import HeldoutCache, ReferenceCache, ReferenceKey, head_sha256, tokenizer_sha256
from evals.reference import LazyReference, describe_reference
from evals.report import drift_png, kl_histogram_png, markdown
from evals.results import (
    ArtifactInfo,
    DriftReport,
    EvaluateResult,
    Evaluation,
    GateOutcome,
    HeldoutResult,
    MmluSummary,
    Numerics,
    ReferenceInfo,
    SequentialSummary,
)
from evals.store import commit_reports
from quantize.common.errors import QpackError
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.io.artifact import content_sha256, load_artifact, read_manifest, verify_artifact
from quantize.io.calibration import CalibrationData
from quantize.model.sources import cache_dir, load_tokenizer
from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import numerics, set_prefill_dtype


def reference_caches(
    config: EvaluateConfig, reference: ReferenceInfo, data_sha256: str, tokenizer_hash: str
) -> dict[str, ReferenceCache | None]:
    """One cache per format, or None per format with --no-cache."""
    root = config.cache_dir or cache_dir()
    return {
        fmt: ReferenceCache(
            root, ReferenceKey(reference.content_sha256, data_sha256, tokenizer_hash, fmt, config.shots)
        )
        if config.cache
        else None
        for fmt in config.formats
    }


def heldout_quality(
    reference: LazyReference,
    candidate: nn.Module,
    calibration: Path,
    tokens: int,
    seed: int,
    progress: Progress,
    cache: HeldoutCache | None = None,
) -> HeldoutResult:
    """Next-token KL and perplexities on held-out calibration queries. The reference's final hidden states come
    from the cache when present, and its head is the candidate's when they are the same weights (the FP32 head
    is kept as is by quantization), so a cached run never loads the reference."""
    from quantize.quality import compare_hidden, eval_packs, reference_hidden
    from quantize.sequential.runner import BlockRunner

    data = CalibrationData.load(calibration)
    packs = eval_packs(data, tokens, seed)
    candidate_head = BlockRunner(candidate).lm_head
    with progress.task(f"Held-out queries: perplexity and KL ({sum(p.num_tokens for p in packs)} tokens)"):
        stored = cache.load(data.manifest_sha256, tokens, seed) if cache is not None else None
        if stored is not None and stored.head_sha256 == head_sha256(candidate_head):
            hidden, head, source = stored.hidden, candidate_head, "cache"
        else:
            model = reference.get()
            hidden, head, source = reference_hidden(model, packs), BlockRunner(model).lm_head, "computed"
            if cache is not None:
                cache.store(data.manifest_sha256, tokens, seed, hidden, head_sha256(head))
        quality = compare_hidden(packs, hidden, reference_hidden(candidate, packs), head, candidate_head)
    return HeldoutResult(
        **dataclasses.asdict(quality),
        calibration_manifest_sha256=data.manifest_sha256,
        reference_hidden=source,
    )


def check_gate(gate: Gate, formats: dict[str, DriftReport], heldout: HeldoutResult | None) -> list[str]:
    reasons = []
    for fmt, report in formats.items():
        if report.sequential is not None:
            reasons += sequential_reasons(fmt, report.sequential)
            continue
        drop = -report.drift_points
        if gate.max_drift is not None and drop > gate.max_drift:
            reasons.append(f"MMLU {fmt} accuracy dropped {drop:.2f} points > --max-drift {gate.max_drift}")
        rate = report.flips.flip_rate
        if gate.max_flip_rate is not None and rate > gate.max_flip_rate:
            reasons.append(f"MMLU {fmt} flip rate {rate:.3f} > --max-flip-rate {gate.max_flip_rate}")
    if gate.max_kl is not None:
        if heldout is not None:
            if heldout.kl > gate.max_kl:
                reasons.append(f"held-out next-token KL {heldout.kl:.4f} > --max-kl {gate.max_kl}")
        else:
            for fmt, report in formats.items():
                if report.answer_kl.mean > gate.max_kl:
                    reasons.append(
                        f"MMLU {fmt} answer KL {report.answer_kl.mean:.4f} > --max-kl {gate.max_kl} "
                        "(no calibration directory, so the answer KL is gated)"
                    )
    return reasons


def sequential_reasons(fmt: str, sequential: SequentialSummary) -> list[str]:
    reasons = [
        f"MMLU {fmt} {'accuracy drop' if name == 'drift' else 'flip rate'} gate undecided after "
        f"{sequential.scored} questions (--max-questions): its {sequential.confidence:.0%} interval still "
        "contains the threshold; allow more questions or loosen the gate"
        for name in sequential.undecided
    ]
    for name, decision in sequential.decisions.items():
        if decision.verdict != "fail":
            continue
        low, high = decision.interval
        what = "accuracy drop (points)" if name == "drift" else "flip rate"
        flag = "--max-drift" if name == "drift" else "--max-flip-rate"
        reasons.append(
            f"MMLU {fmt} {what} is in [{low:.3g}, {high:.3g}] at {sequential.confidence:.0%} confidence after "
            f"{decision.questions} questions, above {flag} {decision.threshold}"
        )
    return reasons


def calibration_dir(config: EvaluateConfig, manifest: dict[str, Any]) -> tuple[Path | None, str | None]:
    """The calibration directory for the held-out comparison (the one asked for, which must exist, else the one
    the artifact was quantized with), or None and why there is none."""
    recorded = manifest.get("calibration", {}).get("path")
    calibration = config.calibration or (Path(recorded) if recorded else None)
    if calibration is not None and (calibration / "manifest.json").is_file():
        return calibration, None
    if config.calibration is not None:
        raise QpackError(f"calibration directory {config.calibration} does not exist; fix `calibration`")
    return None, f"calibration directory {calibration or '(none)'} not found; skipped"


def evaluate(config: EvaluateConfig, progress: Progress = NULL_PROGRESS) -> EvaluateResult:
    """Score the artifact and its reference on MMLU (each format), compare them on held-out queries when the
    calibration directory is at hand, apply the gate, and write the reports into the artifact (if asked)."""
    started = time.perf_counter()
    config.validate()
    artifact_dir = Path(config.artifact).expanduser().resolve()
    manifest = verify_artifact(artifact_dir, read_manifest(artifact_dir))
    data = load_mmlu(config.mmlu, config.subjects, config.limit, config.seed)
    calibration, heldout_note = calibration_dir(config, manifest)

    kernels.enable()  # the kernels the artifact is served with (built once per machine), so what is evaluated
    loaded = load_artifact(artifact_dir, verify=False)  # is what is served; verified just above
    set_prefill_dtype(loaded.model, config.prefill_dtype)
    reference, reference_info = describe_reference(config.reference, manifest, progress)
    scoring = PairScoring(
        reference,
        loaded.model,
        load_tokenizer(artifact_dir),
        data.dev,
        config.shots,
        config.token_budget,
        reference_caches(config, reference_info, data.sha256, tokenizer_sha256(artifact_dir)),
        progress,
    )
    score = score_sequential if config.is_sequential else score_fixed
    formats = score(scoring, config, data.test)
    timings: dict[str, float] = dict(scoring.seconds)
    heldout = None
    if calibration is not None:
        phase = time.perf_counter()
        heldout = heldout_quality(
            reference,
            loaded.model,
            calibration,
            config.heldout_tokens,
            config.seed,
            progress,
            HeldoutCache(config.cache_dir or cache_dir(), reference_info.content_sha256)
            if config.cache
            else None,
        )
        timings["heldout"] = time.perf_counter() - phase
    record = numerics(loaded.model)
    evaluation = Evaluation(
        artifact=ArtifactInfo(loaded.name, loaded.version, str(artifact_dir)),
        reference=reference_info,
        numerics=Numerics(str(record["prefill_dtype"]), record["native_kernels"], str(record["prompt_path"])),
        mmlu=MmluSummary(
            data.layout,
            data.source,
            data.sha256,
            len(data.by_subject()),
            len(data.test),
            config.shots,
            config.limit,
        ),
        formats=formats,
        heldout=heldout,
        heldout_note=heldout_note,
        items_per_second=scoring.items_per_second(),
        reference_cache=scoring.cache_summary(),
        reference_loaded=reference.loaded,
        timings_s={k: round(v, 2) for k, v in timings.items()},
        gate=GateOutcome(tuple(config.gate.checked()), tuple(check_gate(config.gate, formats, heldout))),
        evaluated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seconds=round(time.perf_counter() - started, 2),
    )
    report_dir = (
        write_into_artifact(artifact_dir, content_sha256(manifest), evaluation) if config.write else None
    )
    return EvaluateResult(evaluation, report_dir)


def write_into_artifact(artifact_dir: Path, evaluated_sha256: str, evaluation: Evaluation) -> Path:
    """report.md, mmlu.json and the plots in a fresh report folder, committed with the manifest's `evals.mmlu`
    (the results, a one-line summary per format, the data hash) and file hashes (`evals.store`)."""
    compact = evaluation.to_json()
    files: dict[str, bytes] = {"report.md": markdown(evaluation).encode()}
    for fmt, report in evaluation.formats.items():
        title = (
            f"{evaluation.artifact.name} vs {evaluation.reference.id} ({fmt}, {evaluation.mmlu.shots}-shot)"
        )
        files[f"drift_{fmt}.png"] = drift_png(report, title)
        files[f"answer_kl_{fmt}.png"] = kl_histogram_png(report.kl_values, title)
    files["mmlu.json"] = json.dumps(compact, indent=2).encode()
    summary = "; ".join(
        f"{fmt} acc {r.candidate.accuracy:.1%} (ref {r.reference.accuracy:.1%}, "
        f"drift {r.drift_points:+.2f} pts, flips {r.flips.flip_rate:.1%})"
        for fmt, r in evaluation.formats.items()
    )
    section = {**compact, "summary": summary, "data_sha256": evaluation.mmlu.sha256}
    return commit_reports(artifact_dir, evaluated_sha256, files, section)
