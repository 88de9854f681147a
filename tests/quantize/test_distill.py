"""Distillation's pieces against independent answers: a learned scale dequantizes exactly as the runtime handler
does, the block-by-block backward equals plain autograd through the whole model, rebuilding blocks (streamed)
changes nothing, and the loop keeps its best validation step within its budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantize.algorithms import quantize_rtn
from quantize.common.config import ConfigError
from quantize.common.errors import QpackError
from quantize.config import QuantizeConfig
from quantize.distill import Distill
from quantize.distill.scales import learnable, learned_scale
from quantize.distill.student import Student
from quantize.distill.train import distill, split
from quantize.formats.schemes import BF16, W8A8, Int4, Int8
from quantize.pipeline import quantize_model
from quantize.planning.plan import Plan
from quantize.planning.presets import PRESETS
from quantize.runtime.handlers import handler_for
from quantize.sensitivity.settings import SensitivityConfig
from quantize.sequential.packing import make_packs
from quantize.sequential.runner import BlockRunner
from quantize.sequential.streamed import StreamedModel


@pytest.mark.parametrize("scheme", [Int4(32), Int8()])
def test_a_learned_scale_stores_exactly_the_weight_it_trained_with(scheme) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 128)
    handler = handler_for(scheme)
    tensors = quantize_rtn(scheme, weight)
    learned = learned_scale(scheme, tensors)
    assert torch.equal(learned.weight(), handler.dequantize(scheme, tensors))  # factor 1: the same weight
    with torch.no_grad():
        learned.log_factor.normal_(0.0, 0.05)
    stored = learned.stored(tensors)
    assert stored["scale"].dtype == tensors["scale"].dtype
    assert torch.equal(learned.weight().detach(), handler.dequantize(scheme, stored))
    assert all(torch.equal(stored[k], tensors[k]) for k in tensors if k != "scale")
    assert learnable(Int4(64)) and learnable(Int8()) and not learnable(W8A8()) and not learnable(BF16())


@pytest.fixture(scope="module")
def mixed_artifact(tiny_qwen2_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Int4 layers, int8 down projections and bf16 output projections, on a model whose q/k/v have biases."""
    out = tmp_path_factory.mktemp("distill") / "artifact"
    quantize_model(
        QuantizeConfig(
            output=out,
            calibration=tiny_qwen2_calibration,
            preset=PRESETS["int4"],
            schemes=(Int4(32),),
            overrides={"re:.*down_proj": Int8(), "re:.*o_proj": BF16()},
            sensitivity=SensitivityConfig(num_tokens=64),
            calib_tokens=512,
            eval_tokens=256,
        )
    )
    return out


def _student(model_dir: Path, artifact: Path, keep: bool) -> Student:
    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = load_file(str(artifact / "model.safetensors"))
    schemes = Plan.from_json(manifest["modules"]).quantized()
    return Student(BlockRunner(StreamedModel(model_dir)), tensors, schemes, manifest["tensors"], keep=keep)


def _grad(factor: torch.Tensor) -> torch.Tensor:
    assert factor.grad is not None
    return factor.grad.clone()


def _packs(vocab: int, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in (40, 33, 57, 21)]
    return make_packs(sequences, 64)


def test_the_blockwise_backward_equals_autograd_through_the_whole_model(tiny_qwen2, mixed_artifact) -> None:
    """Plain autograd through every block at once is the independent answer; a rebuilt (streamed) student
    computes the same loss and gradients."""
    kept, rebuilt = _student(tiny_qwen2, mixed_artifact, True), _student(tiny_qwen2, mixed_artifact, False)
    assert kept.factors and all(".o_proj" not in fqn for fqn in kept.factors)  # bf16 layers are not trained
    teacher_runner = BlockRunner(StreamedModel(tiny_qwen2))
    pack = _packs(int(kept.runner.model.config.vocab_size))[0]
    teacher = teacher_runner.final_hidden(pack)[0]
    generator = torch.Generator().manual_seed(1)
    for student in (kept, rebuilt):
        with torch.no_grad():
            for factor in student.factors.values():
                factor.copy_(0.05 * torch.randn(factor.shape, generator=generator))
        generator.manual_seed(1)
    total = kept.backward(pack, teacher, 0.5)
    grads = {fqn: _grad(f) for fqn, f in kept.factors.items()}
    assert rebuilt.backward(pack, teacher, 0.5) == pytest.approx(total, rel=1e-6)
    for fqn, factor in rebuilt.factors.items():
        torch.testing.assert_close(factor.grad, grads[fqn], rtol=1e-5, atol=1e-9)

    for factor in kept.factors.values():
        factor.grad = None
    hidden = kept._embed(pack)
    for index in range(kept.num_layers):
        hidden = kept.run_block(index, hidden, pack)
    normed = kept.runner.norm(hidden)[0]
    loss = kept._chunk_kl(normed, teacher, pack.weights)
    (0.5 * loss).backward()
    assert float(loss.detach()) == pytest.approx(total, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(kept.kl(pack, teacher), rel=1e-5)
    for fqn, factor in kept.factors.items():
        torch.testing.assert_close(factor.grad, grads[fqn], rtol=1e-4, atol=1e-9)
    assert any(float(g.abs().sum()) > 0 for g in grads.values())


def test_the_loop_keeps_the_best_validation_step_and_stops_on_its_budget(tiny_qwen2, mixed_artifact) -> None:
    student = _student(tiny_qwen2, mixed_artifact, True)
    runner = BlockRunner(StreamedModel(tiny_qwen2))
    packs = _packs(int(student.runner.model.config.vocab_size), seed=3)
    teacher = [runner.final_hidden(p)[0] for p in packs]
    ticks = iter(range(10_000))

    def clock() -> float:  # one "second" a call: the budget of 0.5 minutes is a few steps
        return float(next(ticks))

    result = distill(
        student, packs, teacher, Distill(minutes=0.5, eval_every=2, patience=50, lr=1e-2), clock=clock
    )
    assert result.stopped == "budget" and 0 < result.steps < 30
    assert result.validation_kl <= result.validation_kl_before
    assert result.validation_kl == min(p["validation_kl"] for p in result.curve)
    _train, held = split(packs, teacher, Distill())
    from quantize.distill.train import validation_kl

    assert validation_kl(student, packs, teacher, held) == pytest.approx(result.validation_kl, rel=1e-6)
    with pytest.raises(QpackError, match="at least 2 packed calibration rows"):
        split(packs[:1], teacher[:1], Distill())


def test_distill_settings_are_checked_by_field() -> None:
    with pytest.raises(ConfigError) as error:
        QuantizeConfig(
            output=Path("o"), calibration=Path("c"), distill=Distill(minutes=0, lr=1.0, validation=1.5)
        ).validate()
    text = str(error.value)
    assert "distill.minutes" in text and "distill.lr" in text and "distill.validation" in text


def test_a_held_writer_shards_exactly_as_one_that_never_held(tmp_path: Path) -> None:
    """Distillation holds every tensor until it is done; released, they are written in the same shards, each
    group (a module's tensors) in one shard, as a writer that never held them writes."""
    from quantize.io.artifact import ArtifactWriter

    groups = [{f"m{i}.a": torch.full((64 + 16 * i,), float(i)), f"m{i}.b": torch.ones(32)} for i in range(6)]
    layouts = []
    for hold in (False, True):
        folder = tmp_path / f"hold-{hold}"
        folder.mkdir()
        writer = ArtifactWriter(folder, max_shard_bytes=1200)
        if hold:
            writer.hold()
        for group in groups:
            writer.add_fp(group)
        if hold:
            assert not writer.shards and len(writer.pending) == 12
            writer.release()
        names = writer.finish()
        layouts.append([sorted(load_file(str(folder / n))) for n in names])
    assert layouts[0] == layouts[1] and len(layouts[0]) > 2
    assert all(
        f"m{i}.a" in shard and f"m{i}.b" in shard
        for shard in layouts[0]
        for i in range(6)
        if f"m{i}.a" in shard
    )


def test_the_student_keeps_its_blocks_only_beside_what_the_run_holds_throughout(tiny_qwen2: Path) -> None:
    """Kept blocks (twice their FP32 bytes) and the resident embeddings and head must fit in half the limit
    together (at Llama-3-8B's shape and vocabulary the embeddings and head alone are 3.9 GiB)."""
    from quantize.distill.run import keep_blocks

    runner = BlockRunner(StreamedModel(tiny_qwen2))
    streamed = runner.streamed
    assert streamed is not None
    blocks = sum(streamed.block_bytes(i) for i in range(runner.num_layers))
    enough = 2 * (streamed.resident_bytes() + 2 * blocks)
    assert keep_blocks(runner, enough)
    assert not keep_blocks(runner, enough - 4)  # blocks alone would still fit in half of it
    assert 2 * blocks <= 0.5 * (enough - 4)
