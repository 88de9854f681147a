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
