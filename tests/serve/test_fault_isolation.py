"""One request's own numbers fail only that request: a temperature too small to divide by is greedy, and a row
whose sampling or detokenizing raises finishes alone with "error" while the rest of its step goes on. A step
that fails for every row (the model run) still fails them all; /metrics counts the two apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import serve.core.sampler
from quantize.model.sources import load_model, load_tokenizer, resolve_model
from serve.core.request import GREEDY_TEMPERATURE, Request, SamplingParams
from serve.engine.config import CacheConfig, EngineConfig
from serve.engine.core import Engine
from serve.engine.output import RequestOutput

PROMPT = "Once upon a time, there was a little girl named Lily."
OTHER = "Tom and his dog went to the park"


@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> tuple[Any, Any]:
    source = resolve_model(str(stories_dir))
    return load_model(source, dtype=torch.float32), load_tokenizer(source)


def _engine(stories: tuple[Any, Any]) -> Engine:
    model, tokenizer = stories
    return Engine(model, tokenizer, EngineConfig(cache=CacheConfig(memory="8MB")))


def _run(engine: Engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, RequestOutput]:
    """Run `requests` (id -> prompt, params) together; per request its merged output."""
    outputs: dict[str, RequestOutput] = {}

    def collect(output: RequestOutput) -> None:
        seen = outputs.get(output.request_id)
        if seen is not None:
            output.text, output.token_ids = seen.text + output.text, seen.token_ids + output.token_ids
        outputs[output.request_id] = output

    for request_id, (prompt, params) in requests.items():
        engine.add(request_id, engine.tokenizer.encode(prompt), params, collect)
    while engine.has_work():
        engine.step()
    return outputs


def _errors(engine: Engine, scope: str) -> float:
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(f'qpack_request_errors_total{{scope="{scope}"}}'):
            return float(line.split()[-1])
    return 0.0


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.7, seed=5, ignore_eos=True)


def test_temperatures_under_the_epsilon_are_greedy() -> None:
    assert GREEDY_TEMPERATURE == 1e-5
    for temperature in (0.0, 1e-300, 5e-324, 9e-6):
        params = SamplingParams(temperature=temperature)
        assert params.greedy
        assert Request("r", [1, 2], params).generator is None
    assert not SamplingParams(temperature=1e-5).greedy
    assert Request("r", [1, 2], SamplingParams(temperature=1e-5)).generator is not None


def test_a_tiny_temperature_beside_a_greedy_request_is_greedy_and_fails_nobody(stories) -> None:
    alone = _run(_engine(stories), {"g": (PROMPT, GREEDY)})["g"]
    engine = _engine(stories)
    together = _run(engine, {"g": (PROMPT, GREEDY), "tiny": (PROMPT, GREEDY.replace(temperature=1e-300))})
    assert alone.finish_reason == "length" and len(alone.token_ids) == 24
    assert together["g"].text == alone.text and together["g"].finish_reason == "length"
    assert together["tiny"].text == alone.text and together["tiny"].finish_reason == "length"
    assert _errors(engine, "request") == 0 and _errors(engine, "step") == 0


def test_a_row_whose_distribution_is_not_finite_finishes_alone(stories, monkeypatch) -> None:
    alone = _run(_engine(stories), {"a": (PROMPT, SAMPLED), "b": (OTHER, GREEDY)})
    real = serve.core.sampler.distribution

    def poisoned(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        if params.seed == 666:  # the bad request's own numbers: its logits after temperature are NaN
            return real(torch.full_like(logits, float("nan")), params)
        return real(logits, params)

    monkeypatch.setattr(serve.core.sampler, "distribution", poisoned)
    engine = _engine(stories)
    together = _run(
        engine,
        {
            "a": (PROMPT, SAMPLED),
            "bad": (PROMPT, SAMPLED.replace(seed=666)),
            "b": (OTHER, GREEDY),
        },
    )
    assert together["bad"].finish_reason == "error" and together["bad"].token_ids == []
    for request_id in ("a", "b"):
        assert together[request_id].finish_reason == "length"
        assert together[request_id].text == alone[request_id].text
    assert _errors(engine, "request") == 1 and _errors(engine, "step") == 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_row_whose_decode_raises_finishes_alone(stories) -> None:
    alone = _run(_engine(stories), {"a": (PROMPT, GREEDY)})["a"]
    engine = _engine(stories)
    outputs: dict[str, list[RequestOutput]] = {}
    for request_id, prompt in (("a", PROMPT), ("bad", OTHER)):
        engine.add(
            request_id,
            engine.tokenizer.encode(prompt),
            GREEDY,
            lambda o: outputs.setdefault(o.request_id, []).append(o),
        )

    class Broken:
        def add(self, ids: list[int]) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.streams["bad"].detokenizer = Broken()  # type: ignore[assignment]
    while engine.has_work():
        engine.step()
    assert outputs["bad"][-1].finish_reason == "error"
    assert outputs["a"][-1].finish_reason == "length"
    assert "".join(o.text for o in outputs["a"]) == alone.text
    assert _errors(engine, "request") == 1


def test_a_failing_model_run_fails_every_row_and_counts_as_a_step_error(stories) -> None:
    engine = _engine(stories)

    def broken(batch: Any) -> torch.Tensor:
        raise RuntimeError("injected kernel failure")

    engine.runner.run = broken  # type: ignore[method-assign]
    outputs: dict[str, RequestOutput] = {}
    for request_id in ("a", "b"):
        engine.add(
            request_id, engine.tokenizer.encode(PROMPT), GREEDY, lambda o: outputs.update({o.request_id: o})
        )
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.fail_all("RuntimeError: injected kernel failure")  # what `run` does with a failed step
    assert {o.finish_reason for o in outputs.values()} == {"error"} and len(outputs) == 2
    assert _errors(engine, "step") == 2 and _errors(engine, "request") == 0


def test_over_http_a_tiny_temperature_fails_neither_request(stories) -> None:
    """The attack as the issue observed it: two concurrent requests, one with temperature 1e-300; both got a
    500 from the step's shared failure."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from serve.http import BackgroundServer
    from serve.openai import ServerInfo

    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with BackgroundServer(_engine(stories), ServerInfo(name="stories", version="1")) as url:
        alone = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        with ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(
                    lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=60),
                    [body, {**body, "temperature": 1e-300}],
                )
            )
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.json()["choices"][0]["text"] for a in answers] == [alone, alone]
        assert 'finish_reason="error"' not in httpx.get(f"{url}/metrics").text
