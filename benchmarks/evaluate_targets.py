"""Measure `qpack evaluate` speed and the drift of the default artifacts on MMLU, in one run.

The FP32 reference is scored once per format and reused for every artifact (the same prompts, so drift is
paired), each artifact is scored in both formats, and the time per question is split into the per-subject
few-shot prefix (paid once per subject) and the per-question suffix, so the full 14,042-question run is
extrapolated from a `--limit` subset rather than guessed.

    python benchmarks/evaluate_targets.py --artifacts out/int8 out/int4 out/mixed --limit 5 --out out/bench-eval
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

FULL_MMLU = 14042


def timed_score(
    model: Any, tokenizer: Any, fmt: str, data: Any, shots: int
) -> tuple[dict[str, Any], float, float]:
    """Scores, total seconds, and seconds spent on the per-subject prefixes."""
    from evals import scoring

    prefix_time = [0.0]
    original = scoring.Scorer._prefix

    def timed_prefix(self: Any, prefix: list[int]) -> Any:
        started = time.perf_counter()
        try:
            return original(self, prefix)
        finally:
            prefix_time[0] += time.perf_counter() - started

    scoring.Scorer._prefix = timed_prefix  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        scores = scoring.score(model, tokenizer, fmt, data.by_subject(), data.dev, shots)
        return scores, time.perf_counter() - started, prefix_time[0]
    finally:
        scoring.Scorer._prefix = original  # type: ignore[method-assign]


def main() -> None:
    from evals.drift import drift_report
    from evals.mmlu import load_mmlu
    from quantize.common.memory import release_freed_memory
    from quantize.io.artifact import load_artifact
    from quantize.model.sources import load_model, load_tokenizer, resolve_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", type=Path, nargs="+", required=True)
    parser.add_argument("--mmlu", type=Path, default=None)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--formats", nargs="+", default=["letter", "cloze"])
    parser.add_argument("--out", type=Path, default=Path("out/bench-eval"))
    args = parser.parse_args()
    release_freed_memory()
    args.out.mkdir(parents=True, exist_ok=True)
    data = load_mmlu(args.mmlu, limit=args.limit)
    n = len(data.test)
    source = resolve_model("smollm2-135m")
    reference, tokenizer = load_model(source), load_tokenizer(source)
    results: dict[str, Any] = {
        "questions": n,
        "limit": args.limit,
        "shots": args.shots,
        "reference": {},
        "artifacts": {},
    }

    def speed(total: float, prefix: float) -> dict[str, float]:
        suffix = max(total - prefix, 1e-9)
        full = prefix + suffix * FULL_MMLU / n
        return {
            "seconds": total,
            "prefix_seconds": prefix,
            "items_per_s": n / total,
            "suffix_items_per_s": n / suffix,
            "full_mmlu_extrapolated_s": full,
        }

    reference_scores = {}
    for fmt in args.formats:
        scores, total, prefix = timed_score(reference, tokenizer, fmt, data, args.shots)
        reference_scores[fmt] = scores
        results["reference"][fmt] = speed(total, prefix)
        print(f"reference {fmt}: {total:.0f}s ({n / total:.2f} items/s), prefixes {prefix:.0f}s", flush=True)
    for path in args.artifacts:
        loaded = load_artifact(path)
        entry: dict[str, Any] = {"name": loaded.name, "size": loaded.manifest["size"], "formats": {}}
        for fmt in args.formats:
            scores, total, prefix = timed_score(loaded.model, tokenizer, fmt, data, args.shots)
            report = drift_report(data.test, reference_scores[fmt], scores).to_json()
            report.pop("subjects")
            entry["formats"][fmt] = {**report, "speed": speed(total, prefix)}
            print(
                f"{loaded.name} {fmt}: acc {report['candidate']['accuracy']:.3f} (ref {report['reference']['accuracy']:.3f}) "
                f"drift {report['drift_points']:+.2f} [{report['drift_ci95_points'][0]:+.2f}, {report['drift_ci95_points'][1]:+.2f}] "
                f"flips {report['flips']['flip_rate']:.3f} KL {report['answer_kl']['mean']:.4f} time {total:.0f}s",
                flush=True,
            )
        results["artifacts"][str(path)] = entry
        del loaded
    for fmt in args.formats:
        ref = results["reference"][fmt]["full_mmlu_extrapolated_s"]
        arts = [a["formats"][fmt]["speed"]["full_mmlu_extrapolated_s"] for a in results["artifacts"].values()]
        print(
            f"full 5-shot MMLU {fmt}, FP32 + one artifact (extrapolated): {(ref + sum(arts) / len(arts)) / 60:.0f} min"
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
