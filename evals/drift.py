"""Drift statistics between a reference model and an artifact on the same MMLU questions.

Accuracy alone hides damage: two models can agree on accuracy while flipping 5-14% of individual answers. So
drift is reported as the accuracy difference with a *paired* bootstrap CI (both models are scored on the same
questions, so resampling questions keeps their correlation, which makes the interval much tighter and
honest), plus flips (right->wrong, wrong->right, any changed answer), the KL divergence between the two
models' answer distributions (softmax over the four choice scores), and top-1 agreement. Per-model accuracy
gets a Wilson interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from evals.mmlu import Item, by_subject
from evals.results import Accuracy, AnswerKL, DriftReport, Flips, SubjectDrift

Z95 = 1.959963984540054


def wilson_interval(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
    if total == 0:
        return (0.0, 0.0)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, resamples: int = 2000, seed: int = 0, alpha: float = 0.05
) -> tuple[float, float, float]:
    """Mean of (b - a) and its percentile bootstrap CI, resampling pairs. a, b: [N] arrays of 0/1 (or floats)."""
    diff = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    n = diff.shape[0]
    if n == 0:
        return (0.0, 0.0, 0.0)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 500):
        stop = min(start + 500, resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[idx].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return (float(diff.mean()), float(low), float(high))


@dataclass
class ModelResult:
    predictions: dict[str, int]
    correct: dict[str, bool]
    probs: dict[str, torch.Tensor]


def summarize_model(items: list[Item], scores: dict[str, torch.Tensor]) -> ModelResult:
    predictions, correct, probs = {}, {}, {}
    for item in items:
        s = scores[item.key]
        predictions[item.key] = int(torch.argmax(s))
        correct[item.key] = predictions[item.key] == item.answer
        probs[item.key] = torch.softmax(s.to(torch.float64), dim=0)
    return ModelResult(predictions, correct, probs)


def accuracy_block(items: list[Item], result: ModelResult) -> Accuracy:
    right = sum(result.correct[i.key] for i in items)
    return Accuracy(right / max(len(items), 1), wilson_interval(right, len(items)), right, len(items))


def drift_report(
    items: list[Item], reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor], seed: int = 0
) -> DriftReport:
    ref = summarize_model(items, reference)
    cand = summarize_model(items, candidate)
    keys = [item.key for item in items]
    a = np.array([ref.correct[k] for k in keys], dtype=np.float64)
    b = np.array([cand.correct[k] for k in keys], dtype=np.float64)
    drift, low, high = paired_bootstrap(a, b, seed=seed)
    kl = np.array(
        [
            float(
                (
                    ref.probs[k]
                    * (torch.log(ref.probs[k].clamp_min(1e-300)) - torch.log(cand.probs[k].clamp_min(1e-300)))
                ).sum()
            )
            for k in keys
        ]
    )
    changed = sum(ref.predictions[k] != cand.predictions[k] for k in keys)
    n = max(len(keys), 1)
    return DriftReport(
        questions=len(keys),
        reference=accuracy_block(items, ref),
        candidate=accuracy_block(items, cand),
        drift_points=100 * drift,
        drift_ci95_points=(100 * low, 100 * high),
        flips=Flips(
            right_to_wrong=int(((a == 1) & (b == 0)).sum()),
            wrong_to_right=int(((a == 0) & (b == 1)).sum()),
            changed=int(changed),
            flip_rate=changed / n,
        ),
        answer_kl=AnswerKL(
            mean=float(kl.mean()) if len(kl) else 0.0,
            p95=float(np.quantile(kl, 0.95)) if len(kl) else 0.0,
        ),
        top1_agreement=1.0 - changed / n,
        subjects=subject_drift(items, ref, cand, seed),
        kl_values=tuple(kl.tolist()),
    )


def subject_drift(
    items: list[Item], ref: ModelResult, cand: ModelResult, seed: int
) -> dict[str, SubjectDrift]:
    subjects = {}
    for subject, subject_items in sorted(by_subject(items).items()):
        sk = [i.key for i in subject_items]
        sa = np.array([ref.correct[k] for k in sk], dtype=np.float64)
        sb = np.array([cand.correct[k] for k in sk], dtype=np.float64)
        d, lo, hi = paired_bootstrap(sa, sb, resamples=1000, seed=seed)
        subjects[subject] = SubjectDrift(
            n=len(sk),
            reference=float(sa.mean()),
            candidate=float(sb.mean()),
            drift_points=100 * d,
            drift_ci95_points=(100 * lo, 100 * hi),
            flips=int(sum(ref.predictions[k] != cand.predictions[k] for k in sk)),
        )
    return subjects
