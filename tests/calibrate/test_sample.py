from __future__ import annotations

from collections import Counter

from calibrate.sample import allocate, bucket_label, bucket_of, stratified_split


def test_buckets() -> None:
    assert [bucket_of(n) for n in (1, 16, 17, 32, 33, 64, 65, 1000)] == [0, 0, 1, 1, 2, 2, 3, 6]
    assert bucket_label(0) == "1-16" and bucket_label(2) == "33-64"


def test_allocate_largest_remainder_exact_total() -> None:
    assert allocate({0: 50, 1: 30, 2: 20}, 10) == {0: 5, 1: 3, 2: 2}
    assert sum(allocate({0: 7, 1: 7, 2: 7}, 10).values()) == 10
    assert allocate({0: 1, 1: 100}, 50) == {0: 1, 1: 49} or allocate({0: 1, 1: 100}, 50) == {0: 0, 1: 50}
    assert allocate({0: 3}, 10) == {0: 3}


def test_split_is_deterministic_stratified_and_disjoint() -> None:
    lengths = [10] * 600 + [100] * 300 + [400] * 100
    a = stratified_split(lengths, 100, 0.1, seed=7)
    b = stratified_split(lengths, 100, 0.1, seed=7)
    c = stratified_split(lengths, 100, 0.1, seed=8)
    assert a == b and a != c
    assert len(a.train) == 90 and len(a.heldout) == 10
    assert not set(a.train) & set(a.heldout)
    picked = Counter(lengths[i] for i in a.train + a.heldout)
    assert picked == {10: 60, 100: 30, 400: 10}
    held = Counter(lengths[i] for i in a.heldout)
    assert held == {10: 6, 100: 3, 400: 1}


def test_split_smaller_pool_takes_everything() -> None:
    split = stratified_split([5, 50, 500], 512, 0.1, seed=0)
    assert len(split.train) + len(split.heldout) == 3 and len(split.heldout) == 1
