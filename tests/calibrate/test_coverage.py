from __future__ import annotations

from collections import Counter

import pytest

from calibrate.coverage import compare, js_divergence


def test_js_divergence_known_values() -> None:
    assert js_divergence(Counter({"a": 5}), Counter({"a": 2})) == 0.0
    assert js_divergence(Counter({"a": 1}), Counter({"b": 1})) == pytest.approx(1.0)
    # p = (1/2, 1/2), q = (1, 0): JS = 1 - (3/4) log2(4/3) / 1 ... computed by hand = 0.3113
    assert js_divergence(Counter({"a": 1, "b": 1}), Counter({"a": 1})) == pytest.approx(0.311278, abs=1e-5)


def test_compare_flags_a_topic_mismatch_and_passes_a_match() -> None:
    prose = [[1, 2, 3, 4, 5, 6] * 3 for _ in range(50)]
    code = [[100, 101, 102, 103] * 5 for _ in range(50)]
    same = compare([18] * 50, prose, [18] * 50, prose)
    assert same["covered"] and same["token_js"] == 0.0 and same["token_coverage"] == 1.0
    mismatch = compare([18] * 50, prose, [300] * 50, code)
    assert not mismatch["covered"]
    assert mismatch["token_js"] == 1.0 and mismatch["token_coverage"] == 0.0
    assert any("token distribution" in w for w in mismatch["warnings"])
    assert any("length distribution" in w for w in mismatch["warnings"])
