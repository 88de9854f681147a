"""`qpack evaluate`: what quantization cost, measured on MMLU and on held-out user queries, with a CI gate.

The artifact is compared with its reference (by default the exact source model it was quantized from, checked
by weights hash; or any model or other artifact) on the same questions, in each requested prompt format, and
on the held-out calibration queries (perplexity of both, next-token KL). Results, with the sha256 of the
eval data, are written into the artifact manifest's `evals` section and into `ARTIFACT/evals/` (Markdown and
PNGs), atomically, and the manifest's file hashes are updated. Gates then decide the exit code; results are
written before a gate fails the build, so a failing CI run still leaves its evidence.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from evals.mmlu import load_mmlu
from evals.paired import PairScoring, score_fixed, score_sequential
from evals.refcache import HeldoutCache, ReferenceCache, ReferenceKey, head_sha256, tokenizer_sha256
from evals.report import drift_png, kl_histogram_png, markdown
from evals.scoring import FORMATS
from quantize.common.errors import QpackError
from quantize.common.fileio import read_json, sha256_file, write_bytes, write_json
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.io.artifact import FORMAT as ARTIFACT_FORMAT
from quantize.io.artifact import MANIFEST_FILE, content_sha256, load_artifact, read_manifest, verify_artifact
from quantize.io.calibration import CalibrationData
from quantize.model.sources import cache_dir, load_model, load_tokenizer, resolve_model, weights_sha256
from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import PREFILL_DTYPES, numerics, set_prefill_dtype

REPORT_DIR = "evals"


@dataclass(frozen=True)
class Gate:
    max_drift: float | None = None
    max_kl: float | None = None
    max_flip_rate: float | None = None

    def checked(self) -> list[str]:
        return [f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v is not None]


@dataclass(frozen=True)
class EvaluateConfig:
    artifact: Path
    reference: str | None = None
    mmlu: Path | None = None
    subjects: str | None = None
    limit: int | None = None
    shots: int = 5
    formats: tuple[str, ...] = ("letter",)
    calibration: Path | None = None
    heldout_tokens: int = 2048
    gate: Gate = dataclasses.field(default_factory=Gate)
    write: bool = True
    token_budget: int = 4096
    seed: int = 0
    cache: bool = True
    cache_dir: Path | None = None
    sequential: bool = True
    confidence: float = 0.95
    max_questions: int | None = (
        None  # sequential: a gate still undecided after this many fails (a CI time cap)
    )
    # the artifact's prefill GEMM precision (quantize.runtime.modules.PREFILL_DTYPES), as `qpack serve --prefill-dtype`
    # runs it; the reference always runs float32
    prefill_dtype: str = "float32"

    @property
    def is_sequential(self) -> bool:
        """Gated on drift or flips over the whole test set: stop as soon as the gate is decided."""
        gated = self.gate.max_drift is not None or self.gate.max_flip_rate is not None
        return self.sequential and gated and self.limit is None

    def validate(self) -> None:
        problems = []
        if not 0 <= self.shots <= 5:
            problems.append(f"--shots must be 0..5 (got {self.shots})")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            problems.append(
                f"--format must be letter, cloze or both (got {', '.join(self.formats) or 'nothing'})"
            )
        if self.limit is not None and self.limit < 1:
            problems.append(f"--limit must be at least 1 (got {self.limit})")
        for name, value in dataclasses.asdict(self.gate).items():
            if value is not None and value < 0:
                problems.append(f"--{name.replace('_', '-')} must be >= 0 (got {value})")
        if self.max_questions is not None and self.max_questions < 1:
            problems.append(f"--max-questions must be at least 1 (got {self.max_questions})")
        if not 0.5 <= self.confidence < 1:
            problems.append(f"--confidence must be in [0.5, 1) (got {self.confidence})")
        if self.token_budget < 256:
            problems.append("--batch-tokens must be at least 256")
        if self.prefill_dtype not in PREFILL_DTYPES:
            problems.append(
                f"--prefill-dtype must be one of {', '.join(PREFILL_DTYPES)} (got {self.prefill_dtype!r})"
            )
        if problems:
            raise QpackError("invalid evaluate options: " + "; ".join(problems))


@dataclass
class EvaluateResult:
    result: dict[str, Any]
    passed: bool
    reasons: list[str]
    report_dir: Path | None


def _is_artifact(spec: str) -> bool:
    path = Path(spec).expanduser()
    if not (path / MANIFEST_FILE).is_file():
        return False
    try:
        return json.loads((path / MANIFEST_FILE).read_text()).get("format") == ARTIFACT_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


class LazyReference:
    """The reference model, loaded only when something is not in the caches (for a 7B FP32 reference, tens of
    GB and minutes saved per CI run)."""

    def __init__(self, load: Callable[[], nn.Module], progress: Progress) -> None:
        self._load = load
        self._model: nn.Module | None = None
        self.progress = progress

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def get(self) -> nn.Module:
        if self._model is None:
            with self.progress.task("Loading the reference model"):
                self._model = self._load()
        return self._model


def describe_reference(
    spec: str | None, manifest: dict[str, Any], progress: Progress
) -> tuple[LazyReference, dict[str, Any]]:
    """The reference's identity (what its cached results are keyed by) and a loader for the model itself."""
    source = manifest.get("source", {})
    if spec is not None and _is_artifact(spec):
        path = Path(spec).expanduser().resolve()
        reference_manifest = verify_artifact(path, read_manifest(path))
        info = {
            "id": f"{reference_manifest.get('name', path.name)} v{reference_manifest.get('version', '')}",
            "kind": "artifact",
            "path": str(path),
            "content_sha256": content_sha256(reference_manifest),
        }
        return LazyReference(lambda: load_artifact(path, verify=False).model, progress), info
    resolved = resolve_model(spec or source.get("model_id"), progress)
    sha = weights_sha256(resolved)
    if spec is None and source.get("weights_sha256") and sha != source["weights_sha256"]:
        raise QpackError(
            f"the artifact's source model {source.get('model_id')!r} now has different weights ({sha[:12]} vs "
            f"{source['weights_sha256'][:12]}); pass --reference explicitly"
        )
    info = {"id": resolved.model_id, "kind": resolved.kind, "weights_sha256": sha, "content_sha256": sha}
    return LazyReference(lambda: load_model(resolved), progress), info


def reference_caches(
    config: EvaluateConfig, reference_info: dict[str, Any], data_sha256: str, tokenizer_hash: str
) -> dict[str, ReferenceCache | None]:
    """One cache per format, or None per format with --no-cache."""
    root = config.cache_dir or cache_dir()
    return {
        fmt: ReferenceCache(
            root,
            ReferenceKey(reference_info["content_sha256"], data_sha256, tokenizer_hash, fmt, config.shots),
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
) -> dict[str, Any]:
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
    quality["calibration_manifest_sha256"] = data.manifest_sha256
    quality["reference_hidden"] = source
    return quality


def check_gate(gate: Gate, formats: dict[str, dict[str, Any]], heldout: dict[str, Any] | None) -> list[str]:
    reasons = []
    for fmt, report in formats.items():
        if "sequential" in report:
            reasons += sequential_reasons(fmt, report["sequential"])
            continue
        drop = -report["drift_points"]
        if gate.max_drift is not None and drop > gate.max_drift:
            reasons.append(f"MMLU {fmt} accuracy dropped {drop:.2f} points > --max-drift {gate.max_drift}")
        rate = report["flips"]["flip_rate"]
        if gate.max_flip_rate is not None and rate > gate.max_flip_rate:
            reasons.append(f"MMLU {fmt} flip rate {rate:.3f} > --max-flip-rate {gate.max_flip_rate}")
    if gate.max_kl is not None:
        if heldout is not None:
            if heldout["kl"] > gate.max_kl:
                reasons.append(f"held-out next-token KL {heldout['kl']:.4f} > --max-kl {gate.max_kl}")
        else:
            for fmt, report in formats.items():
                if report["answer_kl"]["mean"] > gate.max_kl:
                    reasons.append(
                        f"MMLU {fmt} answer KL {report['answer_kl']['mean']:.4f} > --max-kl {gate.max_kl} "
                        "(no calibration directory, so the answer KL is gated)"
                    )
    return reasons


def sequential_reasons(fmt: str, sequential: dict[str, Any]) -> list[str]:
    reasons = [
        f"MMLU {fmt} {'accuracy drop' if name == 'drift' else 'flip rate'} gate undecided after "
        f"{sequential['scored']} questions (--max-questions): its {sequential['confidence']:.0%} interval still "
        "contains the threshold; allow more questions or loosen the gate"
        for name in sequential["undecided"]
    ]
    for name, decision in sequential["decisions"].items():
        if decision["verdict"] != "fail":
            continue
        low, high = decision["interval"]
        what = "accuracy drop (points)" if name == "drift" else "flip rate"
        flag = "--max-drift" if name == "drift" else "--max-flip-rate"
        reasons.append(
            f"MMLU {fmt} {what} is in [{low:.3g}, {high:.3g}] at {sequential['confidence']:.0%} confidence after "
            f"{decision['questions']} questions, above {flag} {decision['threshold']}"
        )
    return reasons


def _write_reports(root: Path, files: dict[str, bytes]) -> dict[str, str]:
    """Write report files into ROOT/evals atomically (each via temp + rename); returns {relative path: sha256}."""
    folder = root / REPORT_DIR
    folder.mkdir(exist_ok=True)
    hashes = {}
    for name, data in files.items():
        write_bytes(folder / name, data)
        hashes[f"{REPORT_DIR}/{name}"] = sha256_file(folder / name)
    return hashes


def evaluate(config: EvaluateConfig, progress: Progress = NULL_PROGRESS) -> EvaluateResult:
    """Score the artifact and its reference on MMLU (each format), compare them on held-out queries when the
    calibration directory is at hand, apply the gate, and write the reports into the artifact (if asked)."""
    started = time.perf_counter()
    config.validate()
    artifact_dir = Path(config.artifact).expanduser().resolve()
    manifest = verify_artifact(artifact_dir, read_manifest(artifact_dir))
    data = load_mmlu(config.mmlu, config.subjects, config.limit, config.seed)
    calibration = config.calibration or Path(manifest.get("calibration", {}).get("path", ""))
    calibration_ok = bool(str(calibration)) and (Path(calibration) / "manifest.json").is_file()
    if config.calibration is not None and not calibration_ok:
        raise QpackError(f"calibration directory {config.calibration} does not exist; fix --calibration")

    kernels.enable()  # the kernels the artifact is served with (built once per machine), so what is evaluated
    loaded = load_artifact(artifact_dir, verify=False)  # is what is served; verified just above
    set_prefill_dtype(loaded.model, config.prefill_dtype)
    reference, reference_info = describe_reference(config.reference, manifest, progress)
    tokenizer = load_tokenizer(artifact_dir)
    scoring = PairScoring(
        reference,
        loaded.model,
        tokenizer,
        data.dev,
        config.shots,
        config.token_budget,
        reference_caches(config, reference_info, data.sha256, tokenizer_sha256(artifact_dir)),
        progress,
    )
    if config.is_sequential:
        formats = score_sequential(scoring, config, data.test)
    else:
        formats = score_fixed(scoring, config, data.test)
    timings: dict[str, float] = dict(scoring.seconds)
    items_per_second = scoring.items_per_second()
    heldout = None
    if calibration_ok:
        phase = time.perf_counter()
        heldout = heldout_quality(
            reference,
            loaded.model,
            Path(calibration),
            config.heldout_tokens,
            config.seed,
            progress,
            HeldoutCache(config.cache_dir or cache_dir(), reference_info["content_sha256"])
            if config.cache
            else None,
        )
        timings["heldout"] = time.perf_counter() - phase
    reasons = check_gate(config.gate, formats, heldout)
    result: dict[str, Any] = {
        "artifact": {"name": loaded.name, "version": loaded.version, "path": str(artifact_dir)},
        "reference": reference_info,
        "numerics": numerics(loaded.model),
        "mmlu": {
            "layout": data.layout,
            "source": data.source,
            "sha256": data.sha256,
            "subjects": len(data.by_subject()),
            "questions": len(data.test),
            "shots": config.shots,
            "limit": config.limit,
        },
        "formats": formats,
        "heldout": heldout,
        "heldout_note": None
        if calibration_ok
        else f"calibration directory {calibration or '(none)'} not found; skipped",
        "items_per_second": items_per_second,
        "reference_cache": scoring.cache_summary(),
        "reference_loaded": reference.loaded,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "gate": {"checked": config.gate.checked(), "passed": not reasons, "reasons": reasons},
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - started, 2),
    }
    report_dir = None
    if config.write:
        report_dir = _write_into_artifact(artifact_dir, result, loaded.name, config.shots, data.sha256)
    return EvaluateResult(result, not reasons, reasons, report_dir)


def _write_into_artifact(
    artifact_dir: Path, result: dict[str, Any], name: str, shots: int, data_sha256: str
) -> Path:
    """report.md, plots and mmlu.json under ARTIFACT/evals, and the manifest's `evals` section and hashes."""
    formats = result["formats"]
    files: dict[str, bytes] = {"report.md": markdown(result).encode()}
    for fmt, report in formats.items():
        title = f"{name} vs {result['reference']['id']} ({fmt}, {shots}-shot)"
        files[f"drift_{fmt}.png"] = drift_png(report, title)
        files[f"answer_kl_{fmt}.png"] = kl_histogram_png(report["kl_values"], title)
    compact = {
        **result,
        "formats": {f: {k: v for k, v in r.items() if k != "kl_values"} for f, r in formats.items()},
    }
    files["mmlu.json"] = json.dumps(compact, indent=2).encode()
    hashes = _write_reports(artifact_dir, files)
    fresh = read_json(artifact_dir / MANIFEST_FILE, "artifact manifest")
    fresh["files"] = {**fresh.get("files", {}), **hashes}
    summary = "; ".join(
        f"{fmt} acc {r['candidate']['accuracy']:.1%} (ref {r['reference']['accuracy']:.1%}, "
        f"drift {r['drift_points']:+.2f} pts, flips {r['flips']['flip_rate']:.1%})"
        for fmt, r in formats.items()
    )
    fresh.setdefault("evals", {})["mmlu"] = {**compact, "summary": summary, "data_sha256": data_sha256}
    write_json(artifact_dir / MANIFEST_FILE, fresh)
    verify_artifact(artifact_dir)
    return artifact_dir / REPORT_DIR
