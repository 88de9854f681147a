"""Rotations of the residual stream: the Hadamard matrices against their definition, the absorbed rotation against
the unrotated FP32 model's logits, the streamed pass against the whole model, the effect on planted outlier
channels, and a rotated artifact through quantize, load and serve."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from quantize.algorithms.autoround import best_tensors, init_rounding, learn_rounding
from quantize.algorithms.awq import awq_search
from quantize.algorithms.gptq import quantize_gptq
from quantize.algorithms.rtn import fake_quant
from quantize.algorithms.settings import AutoRound
from quantize.common.errors import QpackError
from quantize.formats.schemes import Int4
from quantize.model.sources import load_model, resolve_model
from quantize.rotation.absorb import rotate_block, rotate_model, rotation_for, rotation_problems
from quantize.rotation.hadamard import hadamard, hadamard_order, hadamard_rows, random_hadamard
from quantize.runtime.handlers import handler_for
from quantize.sequential.streamed import StreamedModel

SIZES = (1, 2, 4, 8, 12, 20, 24, 64, 72, 96, 576, 1536)


@pytest.mark.parametrize("n", SIZES)
def test_each_hadamard_matrix_is_one_and_the_fast_transform_is_its_product(n: int) -> None:
    h = hadamard(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(hadamard_rows(x), x @ h, rtol=0, atol=1e-11 * n)
    q = random_hadamard(n, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)


def test_orders_are_built_for_real_widths_and_refused_where_none_is() -> None:
    assert hadamard_order(576).describe() == "8 x Paley(71)"  # type: ignore[union-attr]
    assert hadamard_order(14336).describe() == "64 x Paley(223)"  # type: ignore[union-attr]
    assert hadamard_order(4096).describe() == "4096"  # type: ignore[union-attr]
    assert hadamard_order(6) is None and hadamard_order(10) is None
    with pytest.raises(ValueError, match="order 6"):
        hadamard(6)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("which", ["stories", "qwen2"])
def test_an_absorbed_rotation_leaves_the_fp32_logits_equal(
    stories_dir: Path, tiny_qwen2: Path, which: str
) -> None:
    model = load_model(resolve_model(str(stories_dir if which == "stories" else tiny_qwen2))).eval()
    ids = torch.randint(3, int(model.config.vocab_size), (2, 24), generator=torch.Generator().manual_seed(0))
    reference = _logits(model, ids)
    rotation = rotation_for(model.config, "hadamard", seed=0)
    weights_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    rotate_model(model, rotation)
    assert not torch.allclose(model.model.layers[0].self_attn.q_proj.weight, weights_before)
    torch.testing.assert_close(
        _logits(model, ids), reference, rtol=0, atol=1e-4 * reference.abs().max().item()
    )
    assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in _norms(model))


def _norms(model: nn.Module) -> list[nn.Module]:
    base = model.model  # type: ignore[union-attr]
    return [
        base.norm,
        *(m for layer in base.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)),
    ]


def test_a_wrong_fold_is_caught(stories_dir: Path) -> None:
    """The logit check can fail: rotating without folding a norm's scale changes the model."""
    model = load_model(resolve_model(str(stories_dir))).eval()
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    reference = _logits(model, ids)
    rotation = rotation_for(model.config, "hadamard", seed=0)
    layer = model.model.layers[0]
    scale = layer.input_layernorm.weight.detach().clone()
    rotate_model(model, rotation)
    layer.input_layernorm.weight.data.copy_(scale)  # the scale applied twice: folded and in the norm
    assert (_logits(model, ids) - reference).abs().max() > 1e-2


def test_a_tied_head_is_untied_with_the_final_norm_folded_in(stories_dir: Path) -> None:
    model = load_model(resolve_model(str(stories_dir))).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    rotate_model(model, rotation_for(model.config, "hadamard", seed=0))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not model.config.tie_word_embeddings


def test_the_streamed_model_rotates_each_part_as_the_whole_model_does(stories_dir: Path) -> None:
    model = load_model(resolve_model(str(stories_dir))).eval()
    rotation = rotation_for(model.config, "hadamard", seed=5)
    rotate_model(model, rotation)
    streamed = StreamedModel(stories_dir, rotation=rotation)
    torch.testing.assert_close(streamed.model.lm_head.weight, model.lm_head.weight)
    torch.testing.assert_close(streamed.model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    for index in range(streamed.num_layers):
        with streamed.block(index) as block:
            for name, tensor in block.state_dict().items():
                torch.testing.assert_close(tensor, model.model.layers[index].state_dict()[name], msg=name)


def test_a_model_it_cannot_rotate_is_named_with_why() -> None:
    class Config:
        model_type, hidden_size, num_attention_heads = "gemma", 80, 8  # 80 = 4 x Paley(19); heads of 10: none

    problems = rotation_problems(Config())
    assert len(problems) == 2 and "gemma" in problems[0] and "head dim 10" in problems[1]


def _outlier_linear(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear whose input side has a few planted outlier channels (a norm scale of 40 folded into it) and
    inputs scaled down by the same, so its outputs are ordinary: [out, in] weight, [tokens, in] inputs."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 128, generator=generator)
    inputs = torch.randn(512, 128, generator=generator)
    outliers = torch.ones(128)
    outliers[torch.randperm(128, generator=generator)[:4]] = 40.0
    return weight * outliers, inputs / outliers


def _int4_approximation(
    algorithm: str, scheme: Int4, weight: torch.Tensor, inputs: torch.Tensor
) -> torch.Tensor:
    """The weight each algorithm stores for `weight` [out, in], calibrated on `inputs` [tokens, in]."""
    hessian = inputs.T @ inputs
    if algorithm == "rtn":
        return fake_quant(scheme, weight)
    if algorithm == "gptq":
        return handler_for(scheme).dequantize(scheme, quantize_gptq(scheme, weight, hessian))
    if algorithm == "awq":
        scale, _alpha = awq_search([weight], [scheme], hessian, inputs.pow(2).mean(0).sqrt())
        return fake_quant(scheme, weight * scale[None, :]) / scale[None, :]
    rounding = init_rounding(scheme, weight)
    target = inputs @ weight.T

    def loss(weights: dict[str, torch.Tensor], _step: int) -> list[torch.Tensor]:
        return [((inputs @ weights["w"].T - target) ** 2).mean()]

    learn_rounding({"w": rounding}, loss, AutoRound(iters=60))
    return handler_for(scheme).dequantize(scheme, best_tensors(rounding))


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "autoround"])
def test_rotated_weights_lose_less_to_int4_where_outlier_channels_are_planted(algorithm: str) -> None:
    weight, inputs = _outlier_linear()
    q = random_hadamard(128, seed=0).to(torch.float32)
    scheme = Int4(group_size=32)

    def output_error(w: torch.Tensor, x: torch.Tensor) -> float:
        return float(((x @ w.T - x @ _int4_approximation(algorithm, scheme, w, x).T) ** 2).mean())

    plain, rotated = output_error(weight, inputs), output_error(weight @ q, inputs @ q)
    assert rotated < 0.75 * plain, (plain, rotated)  # measured, seeds 0-2: RTN 0.58-0.70x, GPTQ 0.52-0.63x,
    # AutoRound 0.59-0.73x


def test_awq_runs_on_rotated_weights_but_the_rotation_takes_its_lever() -> None:
    """AWQ is itself an outlier treatment: its per-channel scales rms(x)^alpha undo a folded norm's outlier
    channels exactly (alpha = 1), and a rotation flattens the per-channel statistics they are read from. On the
    planted linear, AWQ alone beats AWQ after a rotation (measured, seeds 0-2: 27-37x lower error; with outliers
    planted in the activations instead, 3.9-5.3x), so what holds, and is asserted, is that on rotated weights
    AWQ still never does worse than RTN, and that unrotated AWQ is the better of the two here."""
    weight, inputs = _outlier_linear()
    q = random_hadamard(128, seed=0).to(torch.float32)
    scheme = Int4(group_size=32)

    def output_error(algorithm: str, w: torch.Tensor, x: torch.Tensor) -> float:
        return float(((x @ w.T - x @ _int4_approximation(algorithm, scheme, w, x).T) ** 2).mean())

    rotated_awq, rotated_rtn = (
        output_error("awq", weight @ q, inputs @ q),
        output_error("rtn", weight @ q, inputs @ q),
    )
    assert rotated_awq <= rotated_rtn * (1 + 1e-6)
    assert output_error("awq", weight, inputs) < 0.2 * rotated_awq


def test_rotate_block_keeps_a_block_s_output(tiny_qwen2: Path) -> None:
    """Per block: the rotated block on the rotated stream is the block on the stream, rotated (biases too)."""
    model = load_model(resolve_model(str(tiny_qwen2))).eval()
    rotation = rotation_for(model.config, "hadamard", seed=2)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 9, int(model.config.hidden_size), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None]
    rope = model.model.rotary_emb(hidden, positions)

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = layer(x, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out

    reference = run(hidden)
    rotate_block(layer, rotation)
    q = rotation.residual.to(torch.float32)
    got = run(hidden @ q)
    torch.testing.assert_close(got, reference @ q, rtol=0, atol=1e-4)


def test_a_rotated_artifact_records_its_rotation_loads_and_generates(
    stories_dir: Path, stories_calibration: Path, tmp_path: Path
) -> None:
    from quantize.config import QuantizeConfig
    from quantize.io.artifact import load_artifact
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS

    out = tmp_path / "rotated"
    result = quantize_model(
        QuantizeConfig(
            output=out,
            calibration=stories_calibration,
            preset=PRESETS["int8"],
            rotate="hadamard",
            calib_tokens=256,
            eval_tokens=128,
        )
    )
    rotation = result.manifest["quantization"]["rotation"]
    assert rotation["kind"] == "hadamard" and rotation["untied_head"] and rotation["residual"]["size"] == 64
    assert result.quality.kl < 0.05
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = load_artifact(out)
    reference = load_model(resolve_model(str(stories_dir))).eval()
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        agree = (loaded.model(ids).logits.argmax(-1) == reference(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.8
    _serve_greedy_matches_the_artifact(out, loaded.model, ids[0].tolist())


def _serve_greedy_matches_the_artifact(artifact: Path, model: nn.Module, prompt: list[int]) -> None:
    """The server's engine on the rotated artifact answers greedily as the artifact's own model does."""
    from serve.core.request import SamplingParams
    from serve.engine.config import CacheConfig, EngineConfig
    from serve.engine.core import Engine
    from serve.loading import load_for_serving

    loaded = load_for_serving(str(artifact))
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(cache=CacheConfig(block_size=4, memory="4MB"))
    )
    tokens: list[int] = []
    engine.add(
        "r",
        prompt,
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        lambda o: tokens.extend(o.token_ids),
    )
    while engine.has_work():
        engine.step()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert tokens == ids[0, len(prompt) :].tolist()


def test_a_model_it_cannot_rotate_is_refused_before_anything_is_written(
    tiny_llama: Path, tiny_llama_calibration: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantize.config import QuantizeConfig
    from quantize.pipeline import quantize_model

    monkeypatch.setattr("quantize.rotation.absorb.ROTATABLE_MODEL_TYPES", ("qwen3",))
    with pytest.raises(QpackError, match="--rotate hadamard cannot be applied"):
        quantize_model(
            QuantizeConfig(output=tmp_path / "a", calibration=tiny_llama_calibration, rotate="hadamard")
        )
    assert not (tmp_path / "a").exists()


def test_rotate_seed_draws_another_rotation_and_defaults_to_the_seed(
    stories_dir: Path, stories_calibration: Path, tmp_path: Path
) -> None:
    from quantize.config import QuantizeConfig
    from quantize.pipeline import _rotation

    source = resolve_model(str(stories_dir))
    config = QuantizeConfig(output=tmp_path / "a", calibration=stories_calibration, rotate="hadamard", seed=4)
    default, drawn = _rotation(config, source), _rotation(dataclasses.replace(config, rotate_seed=9), source)
    assert default is not None and drawn is not None
    assert (default.seed, drawn.seed) == (4, 9) and not torch.equal(default.signs, drawn.signs)


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (None, None),
        ({"kind": "hadamard", "online": None}, None),
        ({"kind": "hadamard", "online": {"before": "down_proj"}}, "online transform"),
        ({"kind": "learned"}, "kind 'learned' is not one"),
        ("hadamard", "record is str, not an object"),
    ],
)
def test_a_rotation_record_not_in_the_weights_is_named(record: object, why: str | None) -> None:
    from quantize.rotation import unabsorbed

    reason = unabsorbed(record)
    assert (reason is None) if why is None else (reason is not None and why in reason)
