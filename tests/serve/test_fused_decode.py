"""The fused native decode step (`kernels.decode_layers`: all decoder layers of a decode step in one call)
against the per-layer loop it replaces, on quantized Llama and Qwen2 models whose layers mix int8, int4, bf16
and FP32 projections (q/k/v split over two weight types), with a layer the fused step can't run (a float16
projection) in the middle, a bf16 KV pool and a sliding window."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from quantize.formats.schemes import BF16, FP16, Int4, Int8, Scheme
from quantize.model.sources import load_tokenizer
from quantize.model.surgery import QuantizedWeight, install
from quantize.runtime.handlers import handler_for
from quantize.runtime.kernels import ops as kernels
from serve.core.config import SchedulerConfig
from serve.core.request import SamplingParams
from serve.engine import core as engine_module
from serve.engine.config import CacheConfig, EngineConfig
from serve.engine.core import Engine
from serve.engine.output import RequestOutput
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="needs a C++ compiler and an AVX2 CPU",
)

PROMPTS = [[1, 5, 9, 33, 71], [1, 200], list(range(40, 77)), [1, 300, 301, 302]]


def _scheme(fqn: str, float16_layer: bool = True) -> Scheme | None:
    layer = int(fqn.split(".")[2])
    if float16_layer and layer == 2 and fqn.endswith("down_proj"):
        return FP16()  # the native kernels read bf16, not float16, weights: the loop takes this layer
    if (layer == 1 and fqn.endswith(("gate_proj", "up_proj"))) or (layer == 4 and "self_attn" in fqn):
        return Int4(group_size=32)
    if fqn.endswith(("v_proj", "down_proj")):
        return BF16()  # q/k/v become two parts: int8 q/k, bf16 v
    if layer == 3 and fqn.endswith("o_proj"):
        return None  # an FP32 projection
    return Int8()


def _model(arch: str, window: int | None, float16_layer: bool = True) -> nn.Module:
    shape = dict(intermediate_size=96, num_hidden_layers=5, tie_word_embeddings=True)
    if arch != "llama":
        shape |= dict(use_sliding_window=window is not None, sliding_window=window)
    model = tiny_model(arch, seed=3, **shape)
    for fqn, module in list(model.named_modules()):
        if (
            isinstance(module, nn.Linear)
            and ".layers." in fqn
            and (scheme := _scheme(fqn, float16_layer)) is not None
        ):
            tensors = handler_for(scheme).quantize(scheme, module.weight.detach())
            install(model, fqn, QuantizedWeight(scheme, "rtn", tensors, module.bias))
    return model


def _generate(engine: Engine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    outputs: dict[str, list[int]] = {}
    logits: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(batch):  # type: ignore[no-untyped-def]
        out = run(batch)
        logits.append(out.clone())
        return out

    engine.runner.run = recording  # type: ignore[method-assign]

    def collect(output: RequestOutput) -> None:
        outputs.setdefault(output.request_id, []).extend(output.token_ids)

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add(f"r{index}", prompt, params, collect)
    while engine.has_work():
        engine.step()
    return outputs, logits


@pytest.mark.parametrize(
    ("arch", "window", "kv_dtype", "copies"),
    [
        ("llama", None, torch.float32, 1),
        ("qwen2", 16, torch.bfloat16, 1),
        ("qwen2", None, torch.float32, 1),
        ("llama", None, torch.float32, 7),  # 28 sequences: fused where the build takes 32 rows (AVX-512)
    ],
)
def test_fused_decode_step_matches_the_layer_loop(
    tiny_llama, arch: str, window: int | None, kv_dtype, copies: int
) -> None:
    prompts = PROMPTS * copies
    model = _model(arch, window)
    tokenizer = load_tokenizer(str(tiny_llama))
    config = EngineConfig(
        cache=CacheConfig(block_size=4, memory="4MB", dtype=str(kv_dtype).removeprefix("torch.")),
        scheduler=SchedulerConfig(max_num_batched_tokens=16 * copies, max_num_seqs=32),
    )
    fused = Engine(model, tokenizer, config)
    assert kernels.ready()
    kinds = [(start, end, run is not None) for start, end, run in fused.runner.segments]
    assert kinds == [(0, 2, True), (2, 3, False), (3, 5, True)]
    loop = Engine(model, tokenizer, config)
    loop.runner.segments = [(0, 5, None)]

    calls: list[int] = []
    real = kernels.decode_layers

    def spy(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    kernels.decode_layers = spy  # type: ignore[assignment]
    try:
        fused_tokens, fused_logits = _generate(fused, prompts)
        if len(prompts) <= kernels.max_rows():  # decode-only steps of all the sequences went through it
            assert calls and max(calls) == len(prompts)
        calls.clear()
        loop_tokens, loop_logits = _generate(loop, prompts)
        assert not calls
    finally:
        kernels.decode_layers = real  # type: ignore[assignment]
    assert fused_tokens == loop_tokens
    assert len(fused_logits) == len(loop_logits)
    for got, expected in zip(fused_logits, loop_logits, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _logits_by_request(
    model: nn.Module,
    tokenizer,
    kv_dtype: torch.dtype,
    budget: int,
    together: bool,
    warm: bool,
    invariant: bool,
) -> dict[str, list[torch.Tensor]]:
    """Every sampled token's logits, per request, with PROMPTS scheduled as asked."""
    config = EngineConfig(
        cache=CacheConfig(block_size=4, memory="4MB", dtype=str(kv_dtype).removeprefix("torch.")),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=32),
        batch_invariant=invariant,
    )
    engine = Engine(model, tokenizer, config)
    if warm:  # the long prompt's first 5 blocks come from the prefix cache, computed by another request
        _generate(engine, [PROMPTS[2][:21]])
    seen: dict[str, list[torch.Tensor]] = {}
    real = engine_module.sample

    def recording(logits: torch.Tensor, requests: list) -> list[int]:  # type: ignore[type-arg]
        for row, request in zip(logits, requests, strict=True):
            seen.setdefault(request.request_id, []).append(row.clone())
        return real(logits, requests)

    engine_module.sample = recording  # type: ignore[assignment]
    try:
        if together:
            _generate(engine, PROMPTS)
        else:
            for index, prompt in enumerate(PROMPTS):
                _generate(engine, [prompt])
                seen[f"alone{index}"] = seen.pop("r0")
    finally:
        engine_module.sample = real  # type: ignore[assignment]
    return {key.replace("alone", "r"): rows for key, rows in seen.items()}


@pytest.mark.parametrize(
    ("arch", "window", "kv_dtype"), [("llama", None, torch.float32), ("qwen2", 16, torch.bfloat16)]
)
def test_batch_invariant_mode_computes_the_same_bits_however_a_prompt_is_scheduled(
    tiny_llama, arch: str, window: int | None, kv_dtype: torch.dtype
) -> None:
    """--batch-invariant: every token's logits are the same bits whether its prompt was prefilled in one step,
    in chunks of 3, a token at a time, among other requests or after a prefix-cache hit (so KV reused from the
    cache or the tiers is the KV a recompute would give). The default mode differs between these paths."""
    model = _model(arch, window, float16_layer=False)
    tokenizer = load_tokenizer(str(tiny_llama))
    reference = _logits_by_request(model, tokenizer, kv_dtype, 1024, False, False, True)
    assert sorted(reference) == [f"r{i}" for i in range(len(PROMPTS))]
    for budget, together, warm in [
        (1024, True, False),
        (3, True, False),
        (1, False, False),
        (1024, False, True),
    ]:
        got = _logits_by_request(model, tokenizer, kv_dtype, budget, together, warm, True)
        for request, rows in reference.items():
            assert len(got[request]) == len(rows) == 24
            for index, (mine, theirs) in enumerate(zip(got[request], rows, strict=True)):
                assert torch.equal(mine, theirs), (budget, together, warm, request, index)
    plain = _logits_by_request(model, tokenizer, kv_dtype, 1024, False, False, False)
    chunked = _logits_by_request(model, tokenizer, kv_dtype, 1, False, False, False)
    assert any(
        not torch.equal(mine, theirs)
        for request in plain
        for mine, theirs in zip(plain[request], chunked[request], strict=True)
    )


def test_batch_invariant_mode_refuses_a_model_the_fused_step_cant_run(tiny_llama) -> None:
    model = _model("llama", None)  # layer 2 has a float16 projection
    with pytest.raises(ValueError, match=r"--batch-invariant: the fused step can't run layers 2 "):
        Engine(
            model,
            load_tokenizer(str(tiny_llama)),
            EngineConfig(cache=CacheConfig(memory="4MB"), batch_invariant=True),
        )
