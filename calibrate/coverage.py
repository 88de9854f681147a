"""Does the calibration set look like production? Length and token-distribution comparison.

The classic way to ruin a quantized model is to calibrate it on the wrong data (a code model on encyclopedia
text): activation ranges, AWQ scales and the sensitivity ranking are then tuned for traffic that never
arrives. Given a sample of production traffic (`--reference`), this compares the two sets on what the model
actually sees: the histogram of token lengths and the unigram distribution of query tokens (without the chat
template, whose fixed tokens would hide a topic mismatch), using Jensen–Shannon divergence in bits (0 =
identical, 1 = disjoint), plus the share of production tokens that calibration never showed the model.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from calibrate.sample import bucket_label, bucket_of

DEFAULT_MAX_TOKEN_JS = 0.45
DEFAULT_MAX_LENGTH_JS = 0.25
DEFAULT_MIN_TOKEN_COVERAGE = 0.90


def js_divergence(p: Counter[Any], q: Counter[Any]) -> float:
    """Jensen–Shannon divergence in bits between two count histograms."""
    total_p = sum(p.values())
    total_q = sum(q.values())
    if total_p == 0 or total_q == 0:
        return 1.0
    divergence = 0.0
    for key in set(p) | set(q):
        pk = p.get(key, 0) / total_p
        qk = q.get(key, 0) / total_q
        mk = (pk + qk) / 2
        if pk > 0:
            divergence += 0.5 * pk * math.log2(pk / mk)
        if qk > 0:
            divergence += 0.5 * qk * math.log2(qk / mk)
    return max(0.0, min(1.0, divergence))


@dataclass(frozen=True)
class CoverageThresholds:
    max_token_js: float = DEFAULT_MAX_TOKEN_JS
    """Coverage warning: Jensen-Shannon divergence of token frequencies above this."""
    max_length_js: float = DEFAULT_MAX_LENGTH_JS
    """Coverage warning: Jensen-Shannon divergence of length buckets above this."""
    min_token_coverage: float = DEFAULT_MIN_TOKEN_COVERAGE
    """Coverage warning: share of the reference's tokens seen in calibration below this."""


def compare(
    calibration_lengths: list[int],
    calibration_tokens: list[list[int]],
    reference_lengths: list[int],
    reference_tokens: list[list[int]],
    thresholds: CoverageThresholds = CoverageThresholds(),
) -> dict[str, Any]:
    cal_hist = Counter(bucket_of(n) for n in calibration_lengths)
    ref_hist = Counter(bucket_of(n) for n in reference_lengths)
    cal_unigrams: Counter[int] = Counter(t for seq in calibration_tokens for t in seq)
    ref_unigrams: Counter[int] = Counter(t for seq in reference_tokens for t in seq)
    length_js = js_divergence(cal_hist, ref_hist)
    token_js = js_divergence(cal_unigrams, ref_unigrams)
    ref_total = sum(ref_unigrams.values())
    covered = sum(n for t, n in ref_unigrams.items() if t in cal_unigrams)
    token_coverage = covered / ref_total if ref_total else 0.0
    warnings: list[str] = []
    if token_js > thresholds.max_token_js:
        warnings.append(
            f"token distribution differs from production (JS {token_js:.3f} > {thresholds.max_token_js}): "
            "calibration queries are about something else"
        )
    if length_js > thresholds.max_length_js:
        warnings.append(
            f"length distribution differs from production (JS {length_js:.3f} > {thresholds.max_length_js})"
        )
    if token_coverage < thresholds.min_token_coverage:
        warnings.append(
            f"only {token_coverage:.1%} of production tokens occur in the calibration set "
            f"(< {thresholds.min_token_coverage:.0%})"
        )
    buckets = sorted(set(cal_hist) | set(ref_hist))
    return {
        "reference_samples": len(reference_lengths),
        "calibration_samples": len(calibration_lengths),
        "length_js": round(length_js, 4),
        "token_js": round(token_js, 4),
        "token_coverage": round(token_coverage, 4),
        "length_histogram": [
            {"tokens": bucket_label(b), "calibration": cal_hist.get(b, 0), "reference": ref_hist.get(b, 0)}
            for b in buckets
        ],
        "thresholds": {
            "max_token_js": thresholds.max_token_js,
            "max_length_js": thresholds.max_length_js,
            "min_token_coverage": thresholds.min_token_coverage,
        },
        "covered": not warnings,
        "warnings": warnings,
    }
