from __future__ import annotations

import pytest

from quantize.algorithms import AWQ, GPTQ
from quantize.common.errors import QpackError
from quantize.formats.schemes import BF16, Int4, Int8
from quantize.planning.plan import Plan, PlanRules

NAMES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.mlp.down_proj",
    "lm_head",
]


def test_precedence_exact_then_regex_in_order_then_default() -> None:
    parsed = PlanRules.parse(
        [
            "_default=int4",
            r"re:.*down_proj=int8",
            r"re:model\.layers\.1\..*=bf16",
            "model.layers.1.mlp.down_proj=keep",
        ]
    )
    rules = PlanRules.of(parsed)
    assert rules == PlanRules.of(
        {
            "_default": Int4(64),
            r"re:.*down_proj": Int8(),
            r"re:model\.layers\.1\..*": BF16(),
            "model.layers.1.mlp.down_proj": None,
        }
    )
    assert rules.lookup("model.layers.0.self_attn.q_proj") == (True, Int4(64), "_default")
    assert rules.lookup("model.layers.0.mlp.down_proj") == (True, Int8(), r"re:.*down_proj")
    assert rules.lookup("model.layers.1.mlp.down_proj") == (True, None, "model.layers.1.mlp.down_proj")
    assert rules.lookup("model.layers.1.self_attn.q_proj") == (True, BF16(), r"re:model\.layers\.1\..*")
    assert PlanRules.of({"re:.*q_proj": Int8()}).lookup("lm_head") == (False, None, "")


def test_bad_rules_are_reported_together() -> None:
    with pytest.raises(ValueError) as excinfo:
        PlanRules.parse(["nonsense", "re:([=int8", "x=int5"])
    message = str(excinfo.value)
    assert "'nonsense' is not PATTERN=SCHEME" in message
    assert "bad regex" in message
    assert "unknown scheme 'int5'" in message
    with pytest.raises(ValueError) as objects:
        PlanRules.of({"re:([": Int8(), "x": "int8", "": None})  # type: ignore[dict-item]
    assert objects.value.args[0].count(";") == 2 and "'x': 'int8' is not a scheme" in str(objects.value)


def test_unmatched_patterns() -> None:
    rules = PlanRules.of(
        PlanRules.parse(["re:.*o_proj=int8", "model.layers.0.mlp.down_proj=int8", "nope=int8"])
    )
    assert rules.unmatched_patterns(NAMES) == ["re:.*o_proj", "nope"]


def test_plan_validation_lists_every_offending_layer() -> None:
    plan = Plan(shapes={"a.layers.0.x": (172, 64), "a.layers.1.x": (172, 64), "a.layers.2.x": (64, 64)})
    plan.schemes = {"a.layers.0.x": Int4(64), "a.layers.1.x": Int4(32), "a.layers.2.x": Int4(64)}
    with pytest.raises(QpackError) as excinfo:
        plan.validate()
    message = str(excinfo.value)
    assert message.startswith("2 layers cannot use their planned scheme")
    assert "int4-g64: in_features 172 is not divisible by group_size 64 for a.layers.0.x" in message
    assert "int4-g32: in_features 172 is not divisible by group_size 32 for a.layers.1.x" in message
    assert "a.layers.2.x" not in message


def test_plan_bits_summary_and_json() -> None:
    plan = Plan(shapes={"model.layers.0.a": (64, 64), "model.layers.0.b": (64, 192), "lm_head": (64, 512)})
    plan.schemes = {"model.layers.0.a": Int8(), "model.layers.0.b": Int4(64), "lm_head": None}
    plan.algorithms = {"model.layers.0.a": GPTQ(), "model.layers.0.b": AWQ()}
    expected = (Int8().bits_per_weight(64, 64) * 4096 + 4.375 * 64 * 192) / (4096 + 64 * 192)
    assert plan.bits() == pytest.approx(expected)
    assert (
        plan.summary(["embed_tokens", "norms"])
        == "quantized 2/3 linears; kept FP32: lm_head, embed_tokens, norms"
    )
    again = Plan.from_json(plan.to_json())
    assert (
        again.schemes == plan.schemes and again.algorithms == plan.algorithms and again.shapes == plan.shapes
    )
