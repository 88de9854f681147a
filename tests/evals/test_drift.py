from __future__ import annotations

import numpy as np
import pytest
import torch

from evals.drift import drift_report, paired_bootstrap, wilson_interval
from evals.mmlu import Item
from evals.results import Flips


def test_wilson_reference_values() -> None:
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0


def test_paired_bootstrap_covers_the_known_difference() -> None:
    rng = np.random.default_rng(0)
    a = (rng.random(4000) < 0.6).astype(float)
    b = a.copy()
    flip = rng.choice(np.flatnonzero(a == 1), size=200, replace=False)  # exactly 5 points lost
    b[flip] = 0
    mean, low, high = paired_bootstrap(a, b, resamples=2000, seed=1)
    assert mean == pytest.approx(-0.05)
    assert low < -0.05 < high and high - low < 0.02  # paired: tight, since only 200 answers differ
    unpaired_width = 2 * 1.96 * np.sqrt(2 * 0.6 * 0.4 / 4000)
    assert high - low < unpaired_width / 2


def test_drift_report_counts() -> None:
    items = [Item("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(4)]
    one_hot = lambda k: torch.tensor([10.0 if j == k else 0.0 for j in range(4)])  # noqa: E731
    reference = {
        items[0].key: one_hot(0),
        items[1].key: one_hot(0),
        items[2].key: one_hot(1),
        items[3].key: one_hot(2),
    }
    candidate = {
        items[0].key: one_hot(0),
        items[1].key: one_hot(3),
        items[2].key: one_hot(0),
        items[3].key: one_hot(1),
    }
    report = drift_report(items, reference, candidate)
    assert report.reference.accuracy == 0.5 and report.candidate.accuracy == 0.5
    assert report.flips == Flips(right_to_wrong=1, wrong_to_right=1, changed=3, flip_rate=0.75)
    assert report.drift_points == 0.0 and report.top1_agreement == 0.25
    assert report.answer_kl.mean > 1.0 and report.kl_values[0] == pytest.approx(0.0, abs=1e-12)
    assert report.subjects["s"].flips == 3 and report.sequential is None
    data = report.to_json()
    assert data["flips"] == {"right_to_wrong": 1, "wrong_to_right": 1, "changed": 3, "flip_rate": 0.75}
    assert data["reference"] == {
        "accuracy": 0.5,
        "ci95": list(report.reference.ci95),
        "correct": 2,
        "total": 4,
    }
    assert "kl_values" not in data and "sequential" not in data and data["subjects"]["s"]["n"] == 4
