"""Scoring a reference and a candidate on the same MMLU questions: all of them, or until a gate is decided.

`PairScoring` holds both models and the reference's score cache, and times each side, so the two ways of
choosing questions stay small: `score_fixed` scores the selected set (the `--limit` sample or everything) and
`score_sequential` scores a seeded uniformly random order in growing chunks, feeding each question's outcome
to the gates' confidence sequences (`evals.sequential`) and stopping once every gate is decided.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from evals.config import EvaluateConfig
from evals.drift import drift_report
from evals.mmlu import Item, by_subject
from evals.refcache import ReferenceCache
from evals.reference import LazyReference
from evals.results import CacheUse, DriftReport, GateDecision, SequentialSummary
from evals.scoring import score
from evals.sequential import GateSequence
from quantize.common.progress import NULL_PROGRESS, Progress

FIRST_CHUNK = (
    600  # questions before the first look; later chunks grow by half (at most 50% scored past a decision)
)


@dataclass
class PairScoring:
    reference: LazyReference
    candidate: nn.Module
    tokenizer: Any
    dev: dict[str, list[Item]]
    shots: int
    token_budget: int
    caches: dict[str, ReferenceCache | None]
    progress: Progress = NULL_PROGRESS
    seconds: dict[str, float] = field(default_factory=dict)
    scored: dict[str, int] = field(default_factory=dict)
    cache_hits: dict[str, int] = field(default_factory=dict)

    def _score(self, model: nn.Module, fmt: str, items: list[Item], label: str) -> dict[str, torch.Tensor]:
        if not items:
            return {}
        started = time.perf_counter()
        scores = score(
            model,
            self.tokenizer,
            fmt,
            by_subject(items),
            self.dev,
            self.shots,
            self.token_budget,
            self.progress,
            label,
        )
        name = f"mmlu_{fmt}_{label}"
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        self.scored[name] = self.scored.get(name, 0) + len(items)
        return scores

    def reference_scores(self, fmt: str, items: list[Item]) -> dict[str, torch.Tensor]:
        cache = self.caches.get(fmt)
        stored = cache.load() if cache is not None else {}
        missing = [item for item in items if item.key not in stored]
        fresh = self._score(self.reference.get(), fmt, missing, "reference") if missing else {}
        if cache is not None and fresh:
            cache.store(fresh)
        self.cache_hits[fmt] = self.cache_hits.get(fmt, 0) + len(items) - len(missing)
        return {item.key: stored[item.key] if item.key in stored else fresh[item.key] for item in items}

    def candidate_scores(self, fmt: str, items: list[Item]) -> dict[str, torch.Tensor]:
        return self._score(self.candidate, fmt, items, "artifact")

    def items_per_second(self) -> dict[str, float]:
        """Question-model pairs scored per second, per format and model."""
        return {name: self.scored[name] / max(seconds, 1e-9) for name, seconds in self.seconds.items()}

    def cache_summary(self) -> dict[str, CacheUse | None]:
        return {
            fmt: CacheUse(str(cache.path), self.cache_hits.get(fmt, 0)) if cache is not None else None
            for fmt, cache in self.caches.items()
        }


def score_fixed(scoring: PairScoring, config: EvaluateConfig, items: list[Item]) -> dict[str, DriftReport]:
    formats = {}
    for fmt in config.formats:
        reference = scoring.reference_scores(fmt, items)
        candidate = scoring.candidate_scores(fmt, items)
        formats[fmt] = drift_report(items, reference, candidate, seed=config.seed)
    return formats


def random_order(items: list[Item], seed: int) -> list[Item]:
    order = list(items)
    random.Random(f"mmlu-order-{seed}").shuffle(order)
    return order


def score_sequential(
    scoring: PairScoring, config: EvaluateConfig, items: list[Item]
) -> dict[str, DriftReport]:
    order = random_order(items, config.seed)
    alpha = 1 - config.confidence
    gates = {
        fmt: GateSequence(len(order), config.gate.max_drift, config.gate.max_flip_rate, alpha)
        for fmt in config.formats
    }
    scores: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {f: ({}, {}) for f in gates}
    position, size = 0, FIRST_CHUNK
    cap = min(len(order), config.max_questions or len(order))
    while position < cap and not all(gate.decided for gate in gates.values()):
        chunk = order[position : min(position + size, cap)]
        for fmt, gate in gates.items():
            reference = scoring.reference_scores(fmt, chunk)
            candidate = scoring.candidate_scores(fmt, chunk)
            scores[fmt][0].update(reference)
            scores[fmt][1].update(candidate)
            for item in chunk:
                ref_choice = int(torch.argmax(reference[item.key]))
                cand_choice = int(torch.argmax(candidate[item.key]))
                gate.add(ref_choice == item.answer, cand_choice == item.answer, ref_choice != cand_choice)
        position += len(chunk)
        size = size + size // 2
    scored = order[:position]
    return {
        fmt: dataclasses.replace(
            drift_report(scored, scores[fmt][0], scores[fmt][1], seed=config.seed),
            sequential=sequential_summary(gate, config, len(order), position),
        )
        for fmt, gate in gates.items()
    }


def sequential_summary(
    gate: GateSequence, config: EvaluateConfig, population: int, scored: int
) -> SequentialSummary:
    decisions = {
        name: GateDecision(
            decision.verdict, decision.questions, (decision.lower, decision.upper), decision.threshold
        )
        for name, decision in gate.decisions.items()
    }
    needed = max((d.questions for d in gate.decisions.values()), default=scored)
    if gate.decided and scored < population:
        reason = f"every gate decided after {needed} of {population} questions"
    elif gate.decided:
        reason = f"all {population} questions scored (the gates' values are then exact)"
    else:
        reason = f"undecided at the --max-questions cap of {scored} questions"
    return SequentialSummary(
        confidence=config.confidence,
        method="without-replacement empirical-Bernstein confidence sequence, uniform seeded order",
        population=population,
        scored=scored,
        questions_needed=needed,
        stopped=reason,
        decisions=decisions,
        undecided=tuple(name for name in gate.gates if name not in gate.decisions),
        drop_interval_points=gate.drop_interval(),
        flip_rate_interval=gate.flip_interval(),
    )
