"""What a CI drift gate costs and decides, on the real default model, in one run.

1. `profile`: where scoring time goes (tokenization, per-subject shared prefixes, question batches, the rest)
   for the FP32 reference and each artifact on a `--limit` sample; questions per second of each, and the
   full 14,042-question time extrapolated from it (uncached: both models; cached: the artifact only).
2. `cache`: the same `qpack evaluate` twice with a fresh reference cache: the first run's time, the second's
   (reference read from the cache), and that both give identical drift reports.
3. `gate`: `qpack evaluate --max-drift 1.0` (sequential) on each artifact, sharing one reference cache, capped
   at `--gate-max-questions`: verdict, questions needed, the confidence interval when it stopped.
4. `lmeval`: FP32 reference scored by `qpack evaluate`'s scorer and by lm-evaluation-harness's own `hf` model
   on the same questions (lm-eval's standard MMLU prompt as local task files): accuracy of each and
   per-question agreement of the chosen letter.

    python benchmarks/mmlu_gate.py --artifacts out/int8 out/int4-rtn-g64 --mmlu ../shared/data/mmlu --out out/gate
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FULL_MMLU = 14042


def profile(artifacts: list[Path], mmlu: Path, limit: int, shots: int) -> dict[str, Any]:
    import torch

    from evals import scoring
    from evals.mmlu import load_mmlu
    from quantize.io.artifact import load_artifact, read_manifest
    from quantize.model.sources import load_model, load_tokenizer, resolve_model

    data = load_mmlu(mmlu, limit=limit)
    tokenizer = load_tokenizer(artifacts[0])
    spent: dict[str, float] = {}

    def timed(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    originals = (scoring.Scorer._prefix, scoring.Scorer._batch, scoring._encode_batch)
    scoring.Scorer._prefix = timed("shared_prefix", originals[0])  # type: ignore[method-assign]
    scoring.Scorer._batch = timed("question_batches", originals[1])  # type: ignore[method-assign]
    scoring._encode_batch = timed("tokenization", originals[2])
    models = {
        "reference (FP32)": load_model(resolve_model(read_manifest(artifacts[0])["source"]["model_id"]))
    }
    for path in artifacts:
        models[path.name] = load_artifact(path).model
    rows = {}
    try:
        for name, model in models.items():
            spent.clear()
            started = time.perf_counter()
            with torch.inference_mode():
                scoring.score(model, tokenizer, "letter", data.by_subject(), data.dev, shots)
            total = time.perf_counter() - started
            rows[name] = {
                "questions": len(data.test),
                "seconds": round(total, 1),
                "questions_per_s": round(len(data.test) / total, 3),
                "split_s": {k: round(v, 1) for k, v in spent.items()}
                | {"other": round(total - sum(spent.values()), 1)},
                "full_mmlu_minutes_extrapolated": round(FULL_MMLU / (len(data.test) / total) / 60, 1),
            }
            print(name, json.dumps(rows[name]), flush=True)
    finally:
        scoring.Scorer._prefix, scoring.Scorer._batch, scoring._encode_batch = originals  # type: ignore[method-assign]
    return {"limit": limit, "shots": shots, "threads": torch.get_num_threads(), "models": rows}


def cache_run(artifact: Path, mmlu: Path, limit: int, shots: int, folder: Path) -> dict[str, Any]:
    from evals import EvaluateConfig, evaluate

    config = EvaluateConfig(
        artifact=artifact, mmlu=mmlu, limit=limit, shots=shots, cache_dir=folder, write=False
    )
    runs = []
    for label in ("first (uncached)", "second (cached reference)"):
        started = time.perf_counter()
        result = evaluate(config).evaluation
        runs.append((label, time.perf_counter() - started, result))
        print(label, round(runs[-1][1], 1), "s", result.to_json()["reference_cache"], flush=True)
    same = runs[0][2].formats["letter"].kl_values == runs[1][2].formats["letter"].kl_values
    return {
        "questions": runs[0][2].mmlu.questions,
        "seconds": {label: round(seconds, 1) for label, seconds, _ in runs},
        "speedup": round(runs[0][1] / runs[1][1], 2),
        "identical_reports": same,
    }


def gate_run(
    artifact: Path, mmlu: Path, shots: int, folder: Path, max_questions: int | None
) -> dict[str, Any]:
    """A sequential --max-drift 1.0 run, capped at MAX_QUESTIONS (undecided there counts as a fail)."""
    from evals import EvaluateConfig, Gate, evaluate

    started = time.perf_counter()
    result = evaluate(
        EvaluateConfig(
            artifact=artifact,
            mmlu=mmlu,
            shots=shots,
            cache_dir=folder,
            write=False,
            gate=Gate(max_drift=1.0),
            max_questions=max_questions,
        )
    ).evaluation.to_json()
    sequential = result["formats"]["letter"]["sequential"]
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "passed": result["gate"]["passed"],
        "reasons": result["gate"]["reasons"],
        "decisions": sequential["decisions"],
        "undecided": sequential["undecided"],
        "questions_needed": sequential["questions_needed"],
        "scored": sequential["scored"],
        "drop_interval_points": sequential["drop_interval_points"],
        "fixed_sample_drift_points": result["formats"]["letter"]["drift_points"],
        "fixed_sample_drift_ci95": result["formats"]["letter"]["drift_ci95_points"],
        "flip_rate": result["formats"]["letter"]["flips"]["flip_rate"],
        "accuracy": {
            "reference": result["formats"]["letter"]["reference"]["accuracy"],
            "artifact": result["formats"]["letter"]["candidate"]["accuracy"],
        },
    }


def lmeval_crosscheck(
    model_id: str, mmlu: Path, subjects: str, limit: int | None, shots: int
) -> dict[str, Any]:
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    from evals.lmeval import write_mmlu_tasks
    from evals.mmlu import load_mmlu
    from evals.scoring import score
    from quantize.model.sources import load_model, load_tokenizer, resolve_model

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    source = resolve_model(model_id)
    data = load_mmlu(mmlu, subjects=subjects)
    if limit is not None:
        data.test = [item for subject in data.by_subject().values() for item in subject[:limit]]
    started = time.perf_counter()
    ours = score(load_model(source), load_tokenizer(source), "letter", data.by_subject(), data.dev, shots)
    ours_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        names = write_mmlu_tasks(Path(folder), data)
        started = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={source.path},dtype=float32",
            tasks=names,
            num_fewshot=shots,
            task_manager=TaskManager(include_path=folder),
            log_samples=True,
            batch_size=4,
            device="cpu",
        )
        theirs_s = time.perf_counter() - started
    agree = right_ours = right_theirs = total = 0
    max_gap = 0.0
    by_key = {item.key: item for item in data.test}
    for name in names:
        subject = name.removeprefix("qpack_mmlu_")
        items = [i for i in data.test if i.subject == subject]
        for sample in out["samples"][name]:
            item = items[sample["doc_id"]]
            theirs = torch.tensor([float(r[0]) for r in sample["filtered_resps"]], dtype=torch.float64)
            mine = ours[item.key]
            max_gap = max(max_gap, float((theirs - mine).abs().max()))
            agree += int(torch.argmax(theirs)) == int(torch.argmax(mine))
            right_ours += int(torch.argmax(mine)) == by_key[item.key].answer
            right_theirs += int(torch.argmax(theirs)) == by_key[item.key].answer
            total += 1
    return {
        "questions": total,
        "subjects": len(names),
        "accuracy_qpack": right_ours / total,
        "accuracy_lm_eval": right_theirs / total,
        "answers_agree": agree / total,
        "max_log_prob_gap": max_gap,
        "seconds": {"qpack": round(ours_s, 1), "lm_eval_hf": round(theirs_s, 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", type=Path, nargs="+", required=True)
    parser.add_argument("--mmlu", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("out/gate"))
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--limit", type=int, default=2, help="questions per subject for profile/cache")
    parser.add_argument("--gate-max-questions", type=int, default=None, help="cap per artifact")
    parser.add_argument("--lmeval-subjects", default="abstract_algebra,business_ethics,global_facts")
    parser.add_argument("--lmeval-limit", type=int, default=None)
    parser.add_argument("--runs", default="profile,cache,gate,lmeval")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.runs.split(",")
    report: dict[str, Any] = {}
    cache = args.out / "cache"
    if "profile" in runs:
        report["profile"] = profile(args.artifacts, args.mmlu, args.limit, args.shots)
    if "cache" in runs:
        report["cache"] = cache_run(args.artifacts[0], args.mmlu, args.limit, args.shots, cache)
    if "gate" in runs:
        report["gate"] = {}
        for artifact in args.artifacts:
            report["gate"][artifact.name] = gate_run(
                artifact, args.mmlu, args.shots, cache, args.gate_max_questions
            )
            print("gate", artifact.name, json.dumps(report["gate"][artifact.name]), flush=True)
    if "lmeval" in runs:
        from quantize.io.artifact import read_manifest

        model_id = read_manifest(args.artifacts[0])["source"]["model_id"]
        report["lmeval"] = lmeval_crosscheck(
            model_id, args.mmlu, args.lmeval_subjects, args.lmeval_limit, args.shots
        )
        print("lmeval", json.dumps(report["lmeval"]), flush=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
