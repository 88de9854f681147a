"""Algorithms on real FP32 weights and activations (stories260k), where quantization quality is genuine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantize import algorithms as A
from quantize.formats.primitives import output_error
from quantize.formats.schemes import Int4, Int8
from quantize.model.sources import load_model, resolve_model
from quantize.runtime.handlers import handler_for
from quantize.sequential.packing import make_packs
from quantize.sequential.runner import BlockRunner


@pytest.fixture(scope="module")
def layer_inputs(
    stories_dir: Path, stories_calibration: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from quantize.io.calibration import CalibrationData

    model = load_model(resolve_model(str(stories_dir)))
    data = CalibrationData.load(stories_calibration)
    captured: dict[str, list[torch.Tensor]] = {}
    names = [
        "model.layers.1.self_attn.q_proj",
        "model.layers.2.mlp.up_proj",
        "model.layers.3.self_attn.o_proj",
    ]
    handles = []
    for name in names:
        module = model.get_submodule(name)
        handles.append(
            module.register_forward_pre_hook(
                lambda _m, args, n=name: captured.setdefault(n, []).append(args[0][0])
            )
        )
    blocks = BlockRunner(model)
    for pack in make_packs(data.train[:64], 256):
        blocks.final_hidden(pack)
    for handle in handles:
        handle.remove()
    return {n: (model.get_submodule(n).weight.detach().clone(), torch.cat(captured[n])) for n in names}


@pytest.mark.parametrize("scheme", [Int8(), Int4(32), Int4(64)], ids=lambda s: s.label())
def test_gptq_beats_rtn_on_real_layers(scheme, layer_inputs) -> None:
    handler = handler_for(scheme)
    for name, (weight, x) in layer_inputs.items():
        h = x.t() @ x
        rtn = handler.dequantize(scheme, A.quantize_rtn(scheme, weight))
        gptq = handler.dequantize(scheme, A.quantize_gptq(scheme, weight, h))
        rtn_error = float(output_error(rtn - weight, h))
        gptq_error = float(output_error(gptq - weight, h))
        assert gptq_error < 0.9 * rtn_error, (name, gptq_error, rtn_error)


def test_gptq_codes_are_on_the_grid(layer_inputs) -> None:
    weight, x = layer_inputs["model.layers.2.mlp.up_proj"]
    tensors = A.quantize_gptq(Int4(32), weight, x.t() @ x, A.GPTQ(act_order=True))
    assert tensors["qweight"].dtype == torch.uint8 and tensors["qweight"].shape == (
        weight.shape[0],
        weight.shape[1] // 2,
    )
    assert tensors["scale"].shape == (weight.shape[0], weight.shape[1] // 32)
    int8 = A.quantize_gptq(Int8(), weight, x.t() @ x)
    assert int8["qweight"].abs().max() <= 127


def test_awq_never_worse_than_rtn_and_usually_better(layer_inputs) -> None:
    improvements = 0
    for name, (weight, x) in layer_inputs.items():
        h = x.t() @ x
        rms = x.pow(2).mean(0).sqrt()
        scale, alpha = A.awq_search([weight], [Int4(32)], h, rms)
        awq = A.fake_quant(Int4(32), weight * scale) / scale
        rtn = A.fake_quant(Int4(32), weight)
        awq_error = float(output_error(awq - weight, h))
        rtn_error = float(output_error(rtn - weight, h))
        assert awq_error <= rtn_error * (1 + 1e-6), name
        improvements += awq_error < rtn_error * 0.99
        assert 0.0 <= alpha <= 1.0
    assert improvements >= 2


def test_singular_hessian_is_damped() -> None:
    weight = torch.randn(8, 16)
    hessian = torch.zeros(16, 16)
    hessian[:4, :4] = torch.eye(4)
    tensors = A.quantize_gptq(Int8(), weight, hessian)
    assert torch.isfinite(handler_for(Int8()).dequantize(Int8(), tensors)).all()


@pytest.mark.parametrize("scheme", [Int8(), Int4(32), Int4(64)], ids=lambda s: s.label())
def test_autoround_starts_from_rtn_or_gptq_exactly_and_stores_what_it_trained(scheme, layer_inputs) -> None:
    handler = handler_for(scheme)
    weight, x = layer_inputs["model.layers.2.mlp.up_proj"]
    h = x.t() @ x
    rtn = A.quantize_rtn(scheme, weight)
    start = A.init_rounding(scheme, weight)
    for name, tensor in A.stored_tensors(start).items():
        assert torch.equal(tensor, rtn[name]), name
    gptq = A.quantize_gptq(scheme, weight, h)
    from_gptq = A.init_rounding(scheme, weight, handler.dequantize(scheme, gptq))
    for name, tensor in A.stored_tensors(from_gptq).items():
        assert torch.equal(tensor, gptq[name]), name
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        start.offset.uniform_(-0.5, 0.5, generator=generator)
        start.min_scale.uniform_(0.6, 1.0, generator=generator)
        start.max_scale.uniform_(0.6, 1.0, generator=generator)
    trained = A.learned_weight(start).detach()
    assert torch.equal(handler.dequantize(scheme, A.stored_tensors(start)), trained)
    assert not torch.equal(trained, handler.dequantize(scheme, rtn))


@pytest.mark.parametrize("scheme", [Int8(), Int4(32)], ids=lambda s: s.label())
def test_autoround_lowers_a_layers_output_error_below_rtn(scheme, layer_inputs) -> None:
    handler = handler_for(scheme)
    settings = A.AutoRound(iters=100)
    for name, (weight, x) in layer_inputs.items():
        h = x.t() @ x
        target = x @ weight.t()
        rounding = A.init_rounding(scheme, weight)

        def loss(weights: dict[str, torch.Tensor], _step: int, x=x, target=target) -> list[torch.Tensor]:
            half = len(x) // 2  # two parts: the loss is their sum, each backpropagated as it comes
            return [
                (x[r] @ weights["w"].t() - target[r]).pow(2).sum() / target.numel()
                for r in (slice(0, half), slice(half, None))
            ]

        result = A.learn_rounding({"w": rounding}, loss, settings)
        assert result.best_loss <= result.initial_loss
        assert float(rounding.offset.detach().abs().max()) <= 0.5
        assert float(rounding.min_scale.detach().min()) >= 0.0
        assert float(rounding.max_scale.detach().max()) <= 1.0
        learned = handler.dequantize(scheme, A.best_tensors(rounding))
        rtn = handler.dequantize(scheme, A.quantize_rtn(scheme, weight))
        gptq = handler.dequantize(scheme, A.quantize_gptq(scheme, weight, h))
        errors = {
            label: float(output_error(w - weight, h))
            for label, w in (("autoround", learned), ("rtn", rtn), ("gptq", gptq))
        }
        assert errors["autoround"] < (0.9 if isinstance(scheme, Int4) else 0.97) * errors["rtn"], (
            name,
            errors,
        )


@pytest.mark.parametrize("scheme", [Int8(), Int4(32)], ids=lambda s: s.label())
def test_autoround_two_stage_backward_takes_plain_autograds_step(scheme, layer_inputs) -> None:
    """One step of `learn_rounding` (each part backpropagated to the fake-quantized weights, then each layer's
    fake quantization again from that gradient) moves the parameters as one plain autograd step through the
    whole graph does (signs may differ only where a gradient is zero up to rounding)."""
    weight, x = layer_inputs["model.layers.2.mlp.up_proj"]
    target = x @ weight.t()
    halves = (slice(0, len(x) // 2), slice(len(x) // 2, None))

    def parts(w: torch.Tensor) -> list[torch.Tensor]:
        return [(x[r] @ w.t() - target[r]).pow(2).sum() / target.numel() for r in halves]

    generator = torch.Generator().manual_seed(3)
    staged, plain = A.init_rounding(scheme, weight), A.init_rounding(scheme, weight)
    with torch.no_grad():
        for r in (staged, plain):
            r.offset.copy_(torch.empty_like(r.offset).uniform_(-0.3, 0.3, generator=generator))
        plain.offset.copy_(staged.offset)
    settings = A.AutoRound(iters=1, lr=0.01)
    A.learn_rounding({"w": staged}, lambda weights, _step: parts(weights["w"]), settings)
    sum(parts(A.learned_weight(plain))).backward()
    with torch.no_grad():
        assert plain.offset.grad is not None and int((plain.offset.grad != 0).sum()) > 0  # the step moves it
        for p in plain.parameters():
            if p.grad is not None:  # int8 has no minimum to clip
                p.sub_(0.01 * torch.sign(p.grad))
    for name in ("offset", "min_scale", "max_scale"):
        low, high = (-0.5, 0.5) if name == "offset" else (0.0, 1.0)
        got, want = getattr(staged, name).detach(), getattr(plain, name).detach().clamp(low, high)
        assert float((got != want).float().mean()) < 1e-3, name


def _learned_weight_by_autograd(r) -> torch.Tensor:
    """The fake quantization written as plain differentiable ops (the chain autograd would keep whole)."""
    from quantize.algorithms.autoround import _FP16_TINY, _grid, _round_ste
    from quantize.formats import primitives as P

    scale, zero = _grid(r)
    n, k = r.weight.shape
    g = r.group_size
    w, v = r.weight.reshape(n, k // g, g), r.offset.reshape(n, k // g, g)
    divisor = scale.clamp_min(_FP16_TINY)[..., None]
    if zero is None:
        q = _round_ste(w / divisor + v).clamp(-P.INT8_MAX, P.INT8_MAX)
        return (q * scale[..., None]).reshape(n, k)
    q = (_round_ste(w / divisor + v) + zero[..., None]).clamp(0, P.INT4_MAX)
    return ((q - zero[..., None]) * scale[..., None]).reshape(n, k)


@pytest.mark.parametrize("scheme", [Int8(), Int4(32), Int4(64)], ids=lambda s: s.label())
def test_autoround_fake_quantization_equals_plain_autograd(scheme, layer_inputs) -> None:
    """The recomputing backward of `learned_weight` gives the gradients plain autograd gives through the same
    ops (to rounding), and the same weight bit for bit, clipped groups, clamped codes and an all-zero group
    included."""
    weight, _x = layer_inputs["model.layers.2.mlp.up_proj"]
    weight = weight.clone()
    weight[3, :64] = 0.0
    generator = torch.Generator().manual_seed(5)
    ours, plain = A.init_rounding(scheme, weight), A.init_rounding(scheme, weight)
    with torch.no_grad():
        ours.offset.uniform_(-0.5, 0.5, generator=generator)
        ours.min_scale.uniform_(0.5, 1.0, generator=generator)
        ours.max_scale.uniform_(0.5, 1.0, generator=generator)
        for name in ("offset", "min_scale", "max_scale"):
            getattr(plain, name).copy_(getattr(ours, name))
    upstream = torch.randn(weight.shape, generator=generator)
    got, want = A.learned_weight(ours), _learned_weight_by_autograd(plain)
    assert torch.equal(got.detach(), want.detach())
    got.backward(upstream)
    want.backward(upstream)
    for name in ("offset", "min_scale", "max_scale"):
        ours_grad, plain_grad = getattr(ours, name).grad, getattr(plain, name).grad
        if plain_grad is None:  # int8 clips no minimum
            assert ours_grad is None or not ours_grad.any(), name
            continue
        assert ours_grad is not None and plain_grad.abs().max() > 0, name
        torch.testing.assert_close(
            ours_grad, plain_grad, rtol=1e-4, atol=1e-5 * float(plain_grad.abs().max())
        )


def test_autoround_settings_are_checked_and_round_trip() -> None:
    with pytest.raises(Exception, match=r"iters.*init"):
        A.AutoRound(iters=0, init="awq").validate()
    settings = A.AutoRound(iters=7, init="gptq", gptq=A.GPTQ(damp=0.05))
    assert A.Algorithm.from_json(settings.to_json()) == settings
    assert settings.learning_rate == pytest.approx(1 / 7)


def test_autoround_keeps_an_all_zero_group_finite_and_zero() -> None:
    scheme = Int4(32)
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    weight[1, :32] = 0.0
    rounding = A.init_rounding(scheme, weight)
    learned = A.learned_weight(rounding)
    assert bool(torch.isfinite(learned).all())
    assert torch.equal(learned[1, :32], torch.zeros(32))
    stored = handler_for(scheme).dequantize(scheme, A.stored_tensors(rounding))
    assert torch.equal(stored, learned.detach())
