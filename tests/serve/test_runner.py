"""Greedy output equals Hugging Face `generate` token for token, alone or in a crowd, on Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch

from quantize.io.artifact import load_artifact
from quantize.model.sources import load_model, load_tokenizer, resolve_model
from serve.core.config import SchedulerConfig
from serve.core.request import SamplingParams
from serve.core.runner import StepBatch
from serve.engine import loop
from serve.engine.config import CacheConfig, EngineConfig
from serve.engine.core import Engine
from serve.engine.output import RequestOutput
from serve.loading import load_for_serving

PROMPTS = [
    [1, 5, 9, 33, 71],
    [1, 200],
    [1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65],
    [1, 300, 301, 302, 303, 304, 305, 306, 307],
    [1, 5, 9, 33, 71, 72, 73],  # shares a prefix with the first prompt
]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}

    def collect(output: RequestOutput) -> None:
        outputs.setdefault(output.request_id, []).extend(output.token_ids)

    for index, prompt in enumerate(prompts):
        engine.add(f"r{index}", prompt, params, collect)
    while engine.has_work():
        engine.step()
    return outputs


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def model_and_tokenizer(request):
    source = resolve_model(str(request.getfixturevalue(request.param)))
    return load_model(source), load_tokenizer(source)


@pytest.mark.parametrize("chunk", [1024, 7])
def test_greedy_matches_hf_generate_alone_and_batched(model_and_tokenizer, chunk: int) -> None:
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(model, p, 12) for p in PROMPTS]
    config = EngineConfig(
        cache=CacheConfig(block_size=4, memory="8MB"),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=16),
    )
    for index, prompt in enumerate(PROMPTS):
        alone = run(Engine(model, tokenizer, config), [prompt], params)
        assert alone["r0"] == expected[index]
    engine = Engine(model, tokenizer, config)
    crowd = run(engine, PROMPTS * 4, params)  # 20 concurrent requests
    for index in range(len(PROMPTS) * 4):
        assert crowd[f"r{index}"] == expected[index % len(PROMPTS)], index
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.pool.hit_rate > 0  # repeated prompts reused cached prefix blocks


def test_an_artifact_serves_the_same_from_the_skeleton(tiny_qwen2_artifact) -> None:
    """The server loads artifacts into the skeleton; the Hugging Face model of the same artifact decodes the same."""
    lean = load_for_serving(str(tiny_qwen2_artifact))
    hf = load_artifact(tiny_qwen2_artifact).model
    assert type(lean.model).__name__ == "CausalLMSkeleton"
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    config = EngineConfig(
        cache=CacheConfig(block_size=4, memory="8MB"), scheduler=SchedulerConfig(max_num_batched_tokens=7)
    )
    ours = run(Engine(lean.model, lean.tokenizer, config), PROMPTS, params)
    theirs = run(Engine(hf, lean.tokenizer, config), PROMPTS, params)
    assert ours == theirs and all(len(tokens) == 10 for tokens in ours.values())


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(model, p, 10) for p in PROMPTS]
    per_token = Engine(
        model, tokenizer, EngineConfig(cache=CacheConfig(block_size=4, memory="8MB"))
    ).kv_bytes_per_token
    config = EngineConfig(
        cache=CacheConfig(block_size=4, memory=str(per_token * 4 * 12)),
        scheduler=SchedulerConfig(max_num_seqs=8),
        max_model_len=40,
    )
    engine = Engine(model, tokenizer, config)
    outputs = run(engine, PROMPTS, params)
    assert engine.scheduler.num_preemptions > 0
    for index in range(len(PROMPTS)):
        assert outputs[f"r{index}"] == expected[index]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_seeded_sampling_is_batch_independent(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    config = EngineConfig(cache=CacheConfig(block_size=4, memory="8MB"))
    alone = run(Engine(model, tokenizer, config), [PROMPTS[0]], params)["r0"]
    crowd = run(Engine(model, tokenizer, config), [PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)["r1"]
    assert alone == crowd and len(alone) == 8
    other = run(Engine(model, tokenizer, config), [PROMPTS[0]], params.replace(seed=8))["r0"]
    assert other != alone


def test_a_continued_answer_samples_what_the_first_engine_would_have(model_and_tokenizer) -> None:
    """A fleet worker taking over after token k: same (seed, index) draws, so the same remaining tokens."""
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    config = EngineConfig(cache=CacheConfig(block_size=4, memory="8MB"))
    whole = run(Engine(model, tokenizer, config), [PROMPTS[3]], params)["r0"]
    texts: list[str] = []
    engine = Engine(model, tokenizer, config)
    rest: list[int] = []

    def collect(output: RequestOutput) -> None:
        rest.extend(output.token_ids)
        texts.append(output.text)
        if output.finished:
            assert (output.prompt_tokens, output.completion_tokens) == (len(PROMPTS[3]), 12)

    sent = len(tokenizer.decode(whole[:5], skip_special_tokens=True))
    engine.add(
        "r0", PROMPTS[3], params.replace(max_tokens=7), collect, resume_ids=whole[:5], resume_chars=sent
    )
    while engine.has_work():
        engine.step()
    assert rest == whole[5:]
    assert tokenizer.decode(whole[:5], skip_special_tokens=True) + "".join(texts) == tokenizer.decode(
        whole, skip_special_tokens=True
    )


def test_compiled_decode_matches_eager(tiny_llama) -> None:
    source = resolve_model(str(tiny_llama))
    model, tokenizer = load_model(source), load_tokenizer(source)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(model, p, 6) for p in PROMPTS[:3]]
    config = EngineConfig(cache=CacheConfig(block_size=4, memory="8MB"), compile=True)
    engine = Engine(model, tokenizer, config)
    engine.runner.segments = [(0, len(engine.runner.plans), None)]  # as for layers the fused step can't run
    compiled = engine.runner._decode_fn
    assert compiled is not None
    calls = []

    def counting(batch: StepBatch) -> torch.Tensor:
        calls.append(batch.num_decode)
        return compiled(batch)

    engine.runner._decode_fn = counting
    loop.warmup(engine)
    outputs = run(engine, PROMPTS[:3], params)
    assert [outputs[f"r{i}"] for i in range(3)] == expected
    assert engine.runner._decode_fn is counting  # still compiled: no fallback to eager happened
    assert 1 in calls and 3 in calls


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_kv_pool_halves_memory_and_stays_close(tiny_llama, kv_dtype: torch.dtype) -> None:
    source = resolve_model(str(tiny_llama))
    model, tokenizer = load_model(source), load_tokenizer(source)
    logits = {}
    for dtype in (torch.float32, kv_dtype):
        engine = Engine(
            model,
            tokenizer,
            EngineConfig(
                cache=CacheConfig(block_size=4, memory="8MB", dtype=str(dtype).removeprefix("torch."))
            ),
        )
        engine.add("r", PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0), lambda _o: None)
        scheduled = engine.scheduler.schedule().scheduled
        logits[dtype] = engine.runner.run(engine.runner.prepare(scheduled))
        assert engine.runner.k_cache[0].dtype == dtype
        per_token = engine.kv_bytes_per_token
    assert (
        per_token * 2
        == Engine(model, tokenizer, EngineConfig(cache=CacheConfig(memory="8MB"))).kv_bytes_per_token
    )
    reference = logits[torch.float32]
    error = (logits[kv_dtype] - reference).abs().max() / reference.abs().max()
    assert 0 < error < 2e-2


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(tiny_llama) -> None:
    import threading

    source = resolve_model(str(tiny_llama))
    engine = Engine(
        load_model(source),
        load_tokenizer(source),
        EngineConfig(cache=CacheConfig(block_size=4, memory="8MB")),
    )
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real_run(batch)

    engine.runner.run = flaky  # type: ignore[method-assign]
    finished: dict[str, RequestOutput] = {}
    done = threading.Event()

    def collect(output: RequestOutput) -> None:
        if output.finished:
            finished[output.request_id] = output
            if len(finished) == 2:
                done.set()

    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(engine, stop), daemon=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add("first", PROMPTS[0], params, collect)
    thread.start()
    try:
        for _ in range(200):
            if "first" in finished:
                break
            threading.Event().wait(0.05)
        engine.add("second", PROMPTS[1], params, collect)
        assert done.wait(30)
    finally:
        stop.set()
        thread.join(10)
    assert finished["first"].finish_reason == "error"
    assert finished["second"].finish_reason == "length" and finished["second"].completion_tokens == 4
    assert "injected kernel failure" in engine.stats.extra["last_error"]
    assert engine.pool.num_free == engine.pool.num_blocks
