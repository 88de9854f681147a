"""Where a 5-shot MMLU scoring run spends its time, per model, and what the full 14,042 questions would take:
the shared few-shot prefix of each subject (prefilled once), the questions' suffixes run over that prefix's KV
(the decoder, batched under the token budget), the LM head at the answer positions, and the rest (tokenizing,
building batches, copying the prefix's KV per batch).

The artifact runs as `qpack evaluate` runs it (`load_artifact`, the native kernels enabled, Hugging Face's
forward), the FP32 reference as it is loaded there too; both score the same subjects (evenly spread over the
57, all their questions), one after the other. The extrapolation scales the prefix time by the number of
subjects and the rest by the number of questions:

    python benchmarks/mmlu_time.py ARTIFACT [--subjects 4] [--shots 5] [--out out/mmlu-time.json]

MMLU comes from QPACK_MMLU_DIR (the Makefile points it at ../shared/data/mmlu).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evals import scoring
from evals.mmlu import by_subject, load_mmlu
from quantize.io.artifact import load_artifact
from quantize.model.sources import load_model, load_tokenizer, resolve_model
from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import numerics

FULL_QUESTIONS, FULL_SUBJECTS = 14_042, 57


class Phases:
    """Seconds spent in the scorer's phases, by wrapping its prefix pass and timing the decoder and the head."""

    def __init__(self) -> None:
        self.seconds = {"prefix": 0.0, "suffix decoder": 0.0, "head": 0.0}
        self.tokens = {"prefix": 0, "suffix": 0, "padded suffix": 0}
        self._in_prefix = False

    def timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                key = "prefix" if self._in_prefix else name
                self.seconds[key] += time.perf_counter() - started

        return wrapper

    def install(self, scorer: scoring.Scorer) -> None:
        decoder, head = scorer.decoder, scorer.lm_head
        setattr(decoder, "forward", self.timed("suffix decoder", decoder.forward))  # noqa: B010
        setattr(head, "forward", self.timed("head", head.forward))  # noqa: B010
        prefix, batch = scorer._prefix, scorer._batch

        def timed_prefix(tokens: list[int]) -> Any:
            self._in_prefix = True
            self.tokens["prefix"] += len(tokens)
            try:
                return prefix(tokens)
            finally:
                self._in_prefix = False

        def counted_batch(prefix_kv: Any, prefix_len: int, requests: list[scoring.Request]) -> Any:
            self.tokens["suffix"] += sum(len(r.tokens) for r in requests)
            self.tokens["padded suffix"] += len(requests) * max(len(r.tokens) for r in requests)
            return batch(prefix_kv, prefix_len, requests)

        setattr(scorer, "_prefix", timed_prefix)  # noqa: B010
        setattr(scorer, "_batch", counted_batch)  # noqa: B010


def time_model(
    model: nn.Module, tokenizer: Any, subjects: dict[str, list[Any]], dev: Any, shots: int
) -> dict[str, Any]:
    phases = Phases()
    original = scoring.Scorer.__init__

    def init(self: scoring.Scorer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        phases.install(self)

    scoring.Scorer.__init__ = init  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        scoring.score(model, tokenizer, "letter", subjects, dev, shots)
        total = time.perf_counter() - started
    finally:
        scoring.Scorer.__init__ = original  # type: ignore[method-assign]
    questions = sum(len(items) for items in subjects.values())
    other = total - sum(phases.seconds.values())
    per_question = (total - phases.seconds["prefix"]) / questions
    full = phases.seconds["prefix"] / len(subjects) * FULL_SUBJECTS + per_question * FULL_QUESTIONS
    return {
        "questions": questions,
        "seconds": {
            **{k: round(v, 2) for k, v in phases.seconds.items()},
            "other": round(other, 2),
            "total": round(total, 2),
        },
        "share": {k: round(v / total, 3) for k, v in {**phases.seconds, "other": other}.items()},
        "tokens": phases.tokens,
        "questions/s": round(questions / total, 2),
        "full MMLU minutes (extrapolated)": round(full / 60, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifact")
    parser.add_argument("--subjects", type=int, default=4)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("out/mmlu-time.json"))
    args = parser.parse_args()
    kernels.enable()
    data = load_mmlu()
    everything = by_subject(data.test)
    names = sorted(everything)
    step = max(1, len(names) // args.subjects)
    chosen = {name: everything[name] for name in names[::step][: args.subjects]}
    loaded = load_artifact(args.artifact)
    tokenizer = load_tokenizer(Path(args.artifact))
    reference = load_model(resolve_model(loaded.manifest["source"]["model_id"]), dtype=torch.float32)
    from qpack.bench.sysinfo import machine_info

    result: dict[str, Any] = {
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "subjects": {name: len(items) for name, items in chosen.items()},
        "artifact numerics": numerics(loaded.model),
    }
    with torch.inference_mode():
        result["artifact"] = time_model(loaded.model, tokenizer, chosen, data.dev, args.shots)
        print("artifact", json.dumps(result["artifact"], indent=1), flush=True)
        result["fp32 reference"] = time_model(reference, tokenizer, chosen, data.dev, args.shots)
        print("fp32 reference", json.dumps(result["fp32 reference"], indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
