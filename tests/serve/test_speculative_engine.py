"""Speculative decoding in the engine, on the genuinely FP32 stories260k model quantized to int8, with an int4
draft built from it: greedy text unchanged for every proposer and k (a stop sequence, max_tokens and EOS falling
inside a proposal included), the pool left as plain decoding leaves it after rejections, aborts in the middle
of a verification, the batch threshold, and sampled output following the target's distribution."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from quantize.formats.schemes import FP16, Int4, Int8
from quantize.model.sources import load_model, load_tokenizer, resolve_model
from quantize.model.surgery import QuantizedWeight, install
from quantize.runtime.handlers import handler_for
from serve.core.request import SamplingParams
from serve.engine.config import CacheConfig, EngineConfig, SpeculationConfig
from serve.engine.core import Engine
from serve.engine.output import RequestOutput
from serve.speculative.draft import quantized_copy
from tests.serve.engines import config_from_options

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="needs a C++ compiler and an AVX2 CPU (speculation verifies on the fused native step)",
)

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "The cat sat on the mat. The cat sat on the",
    "Tom and his dog went to the park",
]


@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> tuple[Any, Any]:
    source = resolve_model(str(stories_dir))
    return source, load_tokenizer(source)


def _target(source: Any, float16_layer: bool = False) -> nn.Module:
    model = load_model(source, dtype=torch.float32)
    for fqn, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and ".layers." in fqn:
            scheme = FP16() if float16_layer and fqn.endswith("layers.1.mlp.down_proj") else Int8()
            tensors = handler_for(scheme).quantize(scheme, module.weight.detach())
            install(model, fqn, QuantizedWeight(scheme, "rtn", tensors, module.bias))
    return model.eval()


def _engine(stories: tuple[Any, Any], mode: str = "off", k: int = 4, **config: Any) -> Engine:
    source, tokenizer = stories
    model = _target(source)
    draft = quantized_copy(model, Int4(group_size=32))[0] if mode in ("draft", "auto") else None
    settings = dict(kv_memory="8MB", speculative=mode, speculative_k=k, draft_kv_memory="4MB") | config
    engine = Engine(model, tokenizer, config_from_options(**settings), draft=draft)
    costs = engine.speculator.policy.costs
    costs.prefill["draft"], costs.smoothing = 0.0, 0.0  # costs fixed: a tiny model drafts on every request
    return engine


def _generate(
    engine: Engine, params: SamplingParams, texts: list[str] = TEXTS, check: Any = None
) -> dict[str, RequestOutput]:
    """Run TEXTS together; per request the merged output (text, ids, finish reason)."""
    outputs: dict[str, RequestOutput] = {}

    def collect(output: RequestOutput) -> None:
        seen = outputs.get(output.request_id)
        if seen is not None:
            output.text, output.token_ids = seen.text + output.text, seen.token_ids + output.token_ids
        outputs[output.request_id] = output

    for index, text in enumerate(texts):
        engine.add(f"r{index}", engine.tokenizer.encode(text), params, collect)
    while engine.has_work():
        engine.step()
        if check is not None:
            check(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    return outputs


def _same(a: dict[str, RequestOutput], b: dict[str, RequestOutput]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert (a[name].token_ids, a[name].text, a[name].finish_reason) == (
            b[name].token_ids,
            b[name].text,
            b[name].finish_reason,
        ), name


@pytest.mark.parametrize("mode", ["ngram", "draft", "auto"])
def test_greedy_text_is_the_same_as_without_speculation(stories: tuple[Any, Any], mode: str) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = _generate(_engine(stories), params)
    for k in (1, 2, 4, 8):
        engine = _engine(stories, mode, k)
        _same(_generate(engine, params), plain)
        summary = engine.speculator.summary()
        assert summary.verify_steps > 0, summary
        if mode != "ngram":
            assert 0 < summary.acceptance < 1, summary  # both kept and rejected proposals were exercised


def test_batch_invariant_engine_speculates_with_the_same_text(stories: tuple[Any, Any]) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = _generate(_engine(stories, batch_invariant=True), params)
    engine = _engine(stories, "auto", 6, batch_invariant=True)
    _same(_generate(engine, params), plain)
    assert engine.speculator.summary().verify_steps > 0


def test_max_tokens_a_stop_sequence_and_eos_inside_a_proposal(stories: tuple[Any, Any]) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = _generate(_engine(stories), params)
    text = plain["r0"].text
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    period = stories[1].encode(".")[-1]
    for change in (
        dict(max_tokens=3),
        dict(max_tokens=7),
        dict(stop=(stop,)),
    ):
        limited = params.replace(**change)
        expected = _generate(_engine(stories), limited)
        assert any(o.finish_reason in ("length", "stop") for o in expected.values())
        for mode in ("draft", "ngram"):
            _same(_generate(_engine(stories, mode, 8), limited), expected)
    # EOS the draft proposes: make "." end every answer
    expected_engine = _engine(stories)
    expected_engine.output.eos_ids = {period}
    expected = _generate(expected_engine, params)
    assert sum(o.finish_reason == "stop" for o in expected.values()) >= 2
    engine = _engine(stories, "draft", 8)
    engine.output.eos_ids = {period}
    _same(_generate(engine, params), expected)


def _pool_state(engine: Engine) -> None:
    """After every step: each running request holds exactly the blocks of its computed tokens, registered where
    full, and every reference in the pool belongs to one of them."""
    size = engine.config.cache.block_size
    held = Counter[int]()
    for request in engine.scheduler.running:
        assert len(request.block_ids) == -(-request.num_computed // size), request.request_id
        assert request.num_registered == request.num_computed // size
        assert request.num_computed <= request.num_tokens
        held.update(request.block_ids)
    for block in engine.pool.blocks:
        assert block.ref_cnt == held[block.block_id], block


def _registered(engine: Engine) -> list[bytes]:
    keys: list[bytes] = []
    register = engine.pool.register

    def recording(block_id: int, key: bytes) -> None:
        keys.append(key)
        register(block_id, key)

    engine.pool.register = recording  # type: ignore[method-assign]
    return keys


def test_rejected_tokens_leave_the_pool_as_plain_decoding_does(stories: tuple[Any, Any]) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain_engine = _engine(stories)
    plain_keys = _registered(plain_engine)
    _generate(plain_engine, params, check=_pool_state)
    engine = _engine(stories, "draft", 8)
    keys = _registered(engine)
    _generate(engine, params, check=_pool_state)
    summary = engine.speculator.summary()
    assert summary.accepted["draft"] < summary.proposed["draft"]  # there were rejections to roll back
    assert sorted(keys) == sorted(plain_keys)  # only blocks of real tokens were ever registered (and written)
    assert set(engine.pool._cached) == set(plain_engine.pool._cached)
    metrics = engine.metrics.render().decode()
    proposed = summary.proposed["draft"]
    assert f'qpack_spec_proposed_tokens_total{{source="draft"}} {float(proposed)}' in metrics
    assert f"qpack_spec_verify_steps_total {float(summary.verify_steps)}" in metrics
    assert f"qpack_spec_acceptance_rate {summary.acceptance}" in metrics


@pytest.mark.parametrize("when", ["drafting", "verifying"])
def test_an_abort_in_the_middle_of_a_verification_frees_everything(
    stories: tuple[Any, Any], when: str
) -> None:
    engine = _engine(stories, "draft", 4)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    aborted: list[str] = []

    def abort_once() -> None:
        if not aborted and engine.speculator.steps >= 2:
            aborted.append("r1")
            assert engine.abort("r1")

    if when == "drafting":
        draft = engine.speculator.draft

        def drafting(plan: Any) -> None:
            draft(plan)
            abort_once()

        engine.speculator.draft = drafting  # type: ignore[method-assign]
    else:
        run = engine.runner.run

        def verifying(batch: Any) -> torch.Tensor:
            logits = run(batch)
            if batch.num_decode > len(engine.scheduler.running):
                abort_once()
            return logits

        engine.runner.run = verifying  # type: ignore[method-assign]
    outputs = _generate(engine, params, check=_pool_state)
    assert aborted == ["r1"]
    assert "r1" not in engine.streams and not outputs["r1"].finished  # its caller gave up on it
    assert outputs["r0"].finished and outputs["r2"].finished
    engine.step()
    assert engine.speculator.draft_model is not None and not engine.speculator.draft_model.sequences
    assert engine.speculator.draft_model.pool.num_free == engine.speculator.draft_model.pool.num_blocks


def test_no_step_above_the_batch_threshold_speculates(stories: tuple[Any, Any]) -> None:
    engine = _engine(stories, "ngram", 4, speculative_max_batch=2)
    prepare = engine.runner.prepare
    seen: list[tuple[int, bool]] = []

    def recording(items: Any) -> Any:
        seen.append((len(items), any(i.proposal for i in items)))
        return prepare(items)

    engine.runner.prepare = recording  # type: ignore[method-assign]
    texts = [*TEXTS, "The cat sat on the mat. The cat sat on the mat. The cat"]
    for index, (text, limit) in enumerate(zip(texts, (8, 16, 40, 40), strict=True)):
        params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
        engine.add(f"r{index}", engine.tokenizer.encode(text), params, lambda _output: None)
    while engine.has_work():
        engine.step()
    assert any(speculated for _n, speculated in seen)
    assert any(n > 2 for n, _speculated in seen)
    assert all(n <= 2 for n, speculated in seen if speculated)


def test_speculation_refuses_a_model_the_fused_step_cannot_verify(stories: tuple[Any, Any]) -> None:
    model = _target(stories[0], float16_layer=True)
    with pytest.raises(ValueError, match="fused native step"):
        Engine(
            model,
            stories[1],
            EngineConfig(cache=CacheConfig(memory="8MB"), speculation=SpeculationConfig(mode="ngram")),
        )
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(
            _target(stories[0]),
            stories[1],
            EngineConfig(cache=CacheConfig(memory="8MB"), speculation=SpeculationConfig(mode="draft")),
        )


def test_sampled_tokens_follow_the_targets_distribution(stories: tuple[Any, Any]) -> None:
    """Token 2 given token 1 (verified with a draft proposal), over 1500 seeds, against the target's own next-token
    distribution: Pearson's chi-squared, tail cells merged."""
    engine = _engine(stories, "draft", 2)
    params = SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True)
    prompt = engine.tokenizer.encode(TEXTS[0])
    pairs: dict[str, list[int]] = {}
    for seed in range(1500):
        engine.add(
            f"s{seed}",
            prompt,
            params.replace(seed=seed),
            lambda o: pairs.setdefault(o.request_id, []).extend(o.token_ids),
        )
        if seed % 4 == 3:
            while engine.has_work():
                engine.step()
    while engine.has_work():
        engine.step()
    assert engine.speculator.summary().verify_steps > 1000
    first = Counter(ids[0] for ids in pairs.values()).most_common(1)[0][0]
    seconds = Counter(ids[1] for ids in pairs.values() if ids[0] == first)
    with torch.no_grad():
        logits = engine.model(torch.tensor([[*prompt, first]])).logits[0, -1]
    probs = torch.softmax(logits / 0.8, dim=-1)
    total = sum(seconds.values())
    cells = [t for t in range(probs.shape[0]) if probs[t] * total >= 5]
    observed = [seconds[t] for t in cells] + [total - sum(seconds[t] for t in cells)]
    expected = [float(probs[t]) * total for t in cells] + [total * (1 - float(probs[cells].sum()))]
    if expected[-1] < 5:
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(cells) - (0 if len(observed) > len(cells) else 1)
    # the chi-squared 0.999 quantile, Wilson-Hilferty: dof (1 - 2/(9 dof) + 3.09 sqrt(2/(9 dof)))^3
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert total > 200 and dof >= 3
    assert stat < critical, (stat, critical, dof, total)


def test_a_seeded_sampled_request_repeats_with_speculation(stories: tuple[Any, Any]) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5)
    runs = [_generate(_engine(stories, "draft", 4), params) for _ in range(2)]
    _same(runs[0], runs[1])
