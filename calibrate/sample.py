"""Deterministic, length-stratified sampling and the held-out split.

Query lengths in production are heavy-tailed: most are short, a few are long and carry most of the tokens. A
plain random sample of 512 can miss the long tail entirely, and the statistics (and later the quantization
error) depend on sequence position. So samples are drawn per token-length bucket (powers of two), in
proportion to the bucket's share of the pool, with the largest-remainder method so the total is exact. The
held-out split is stratified the same way, so perplexity/KL checks see the same length mix as calibration.
Everything is a function of `seed` alone.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any


def bucket_of(length: int) -> int:
    """Bucket index: 0 for lengths 1..16, then one bucket per power of two (17..32, 33..64, ...)."""
    return max(0, math.ceil(math.log2(max(length, 1))) - 4)


def bucket_label(bucket: int) -> str:
    low = 1 if bucket == 0 else 2 ** (bucket + 4 - 1) + 1
    high = 2 ** (bucket + 4)
    return f"{low}-{high}"


def allocate(sizes: dict[int, int], total: int) -> dict[int, int]:
    """Split `total` across buckets in proportion to `sizes` (largest remainder), never above a bucket's size."""
    pool = sum(sizes.values())
    total = min(total, pool)
    if pool == 0 or total == 0:
        return dict.fromkeys(sizes, 0)
    quotas = {b: total * n / pool for b, n in sizes.items()}
    taken = {b: min(sizes[b], math.floor(q)) for b, q in quotas.items()}
    remaining = total - sum(taken.values())
    order = sorted(sizes, key=lambda b: (-(quotas[b] - math.floor(quotas[b])), b))
    while remaining > 0:
        progressed = False
        for b in order:
            if remaining == 0:
                break
            if taken[b] < sizes[b]:
                taken[b] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            break
    return taken


@dataclass(frozen=True)
class Split:
    train: list[int]
    heldout: list[int]
    buckets: list[dict[str, Any]]


def stratified_split(lengths: list[int], num_samples: int, heldout_fraction: float, seed: int) -> Split:
    """Pick `num_samples` indices stratified by length; `heldout_fraction` of them form the held-out split."""
    rng = random.Random(seed)
    by_bucket: dict[int, list[int]] = defaultdict(list)
    for index, length in enumerate(lengths):
        by_bucket[bucket_of(length)].append(index)
    sizes = {b: len(ix) for b, ix in sorted(by_bucket.items())}
    picks = allocate(sizes, num_samples)
    chosen: dict[int, list[int]] = {}
    for bucket, count in picks.items():
        chosen[bucket] = rng.sample(by_bucket[bucket], count)
    total = sum(picks.values())
    num_heldout = round(total * heldout_fraction)
    if heldout_fraction > 0 and total >= 2:
        num_heldout = min(max(num_heldout, 1), total - 1)
    heldout_picks = allocate(picks, num_heldout)
    train: list[int] = []
    heldout: list[int] = []
    buckets: list[dict[str, Any]] = []
    for bucket in sorted(chosen):
        members = chosen[bucket]
        cut = heldout_picks.get(bucket, 0)
        heldout.extend(members[:cut])
        train.extend(members[cut:])
        buckets.append(
            {
                "tokens": bucket_label(bucket),
                "pool": sizes[bucket],
                "train": len(members) - cut,
                "heldout": cut,
            }
        )
    return Split(sorted(train), sorted(heldout), buckets)
