from __future__ import annotations

import json

import pytest

from quantize.common.errors import QpackError
from quantize.formats.schemes import (
    BF16,
    FP16,
    FP32,
    SCHEMES,
    W8A8,
    BnbInt8,
    BnbNF4,
    Int4,
    Int8,
    Scheme,
    parse_scheme,
)

ALL = [FP32(), BF16(), FP16(), Int8(), Int4(32), Int4(64), Int4(128), W8A8(alpha=0.6), BnbInt8(), BnbNF4()]


@pytest.mark.parametrize("scheme", ALL, ids=lambda s: s.label())
def test_json_round_trip(scheme: Scheme) -> None:
    data = json.loads(json.dumps(scheme.to_json()))
    assert data["type"] == scheme.type and data["version"] == 1
    assert Scheme.from_json(data) == scheme


def test_registry_covers_every_scheme_and_rejects_unknown() -> None:
    assert set(SCHEMES) == {"fp32", "bf16", "fp16", "int8", "int4", "w8a8", "bnb-int8", "bnb-nf4"}
    with pytest.raises(QpackError, match="unknown scheme type 'int3'"):
        Scheme.from_json({"type": "int3"})
    with pytest.raises(QpackError, match="newer than this qpack"):
        Scheme.from_json({"type": "int8", "version": 99})


def test_parse_shorthand() -> None:
    assert parse_scheme("int4-g128") == Int4(128)
    assert parse_scheme("INT8") == Int8()
    assert parse_scheme("keep") is None and parse_scheme("fp32") is None
    with pytest.raises(QpackError, match="unknown scheme 'int5'"):
        parse_scheme("int5")
    with pytest.raises(QpackError, match="only int4 takes a group size"):
        parse_scheme("int8-g64")


def test_bits_and_problems() -> None:
    assert Int4(64).bits_per_weight(576, 576) == pytest.approx(4.375)
    assert Int8().bits_per_weight(576, 1536) == pytest.approx(8 + 32 / 576)
    assert BF16().bits_per_weight(1, 1) == 16
    assert Int4(128).problems(576, 10) == ["in_features 576 is not divisible by group_size 128"]
    assert Int4(48).problems(96, 10) == ["group_size 48 is not one of (32, 64, 128)"]
    assert Int4(64).problems(1536, 10) == []
    assert W8A8(alpha=1.5).problems(8, 8)
