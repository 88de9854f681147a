"""Applying a plan block by block: fold AWQ/SmoothQuant scales, quantize with GPTQ or RTN, write, move on.

Calibration activations enter block 0 and are carried forward through each block *after* it is quantized, so
every block is calibrated on the inputs it will really see (the errors of the blocks before it included), and
peak memory is one block's weights plus the activations. Per block: the input Hessians its groups need (only
when an algorithm uses them), scale folding for each input group (AWQ searches a per-channel scale,
SmoothQuant computes one; folded into the previous norm or linear, or kept beside a w8a8 weight), then each
planned linear quantized in place of its float weight, which is overwritten with its dequantized form for the
next block's inputs.

AutoRound learns a block's rounding jointly over its linears: its targets are the FP32 block's outputs on the
FP32 model's inputs, so with it the pass also carries the FP32 activations (one more list of hidden states) and
runs each block once more, before it is quantized.

The same single pass measures the result: held-out sequences are carried through each block twice, through
the original FP32 weights (before anything changes) and through the block's runtime quantized modules (real
kernel numerics), so the final KL/PPL against FP32 needs no second pass and no second copy of the model. With a
`StreamedModel` each block is read from the checkpoint, used, written to the artifact and dropped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from quantize import algorithms as A
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.formats.schemes import W8A8, Int4, Int8, Scheme
from quantize.io.artifact import ArtifactWriter
from quantize.io.calibration import ChannelStats
from quantize.model.surgery import (
    InputGroup,
    QuantizedWeight,
    fold_input_scale,
    get_linear,
    get_module,
    input_groups,
    install,
)
from quantize.planning.plan import Plan
from quantize.runtime.handlers import handler_for
from quantize.runtime.modules import prefill_dtype_set
from quantize.sequential.packing import Pack, make_packs, row_batches
from quantize.sequential.runner import BlockRunner, input_hessians


@dataclass
class _Run:
    """What every block of one run shares."""

    blocks: BlockRunner
    plan: Plan
    stats: dict[str, ChannelStats]
    num_tokens: int

    @property
    def learns_rounding(self) -> bool:
        return any(isinstance(a, A.AutoRound) for a in self.plan.algorithms.values())


@dataclass
class PassResult:
    """What the pass leaves besides the written weights: per-module info and the held-out final hidden states
    (normed) of the FP32 model and of the quantized one."""

    info: dict[str, dict[str, Any]]
    reference: list[torch.Tensor]
    candidate: list[torch.Tensor]
    reference_head: nn.Module
    candidate_head: nn.Module
    packs: list[Pack]  # the calibration rows the pass ran on
    teacher: list[torch.Tensor]  # with `teacher=True`: their FP32 final normed hidden states [T, H]
    # with `int8_prompts=True`: the quantized model's, its prompt-sized products on int8 activations
    candidate_int8: list[torch.Tensor] | None = None


def apply_plan(
    blocks: BlockRunner,
    plan: Plan,
    stats: dict[str, ChannelStats],
    calibration: list[torch.Tensor],
    writer: ArtifactWriter,
    eval_packs: list[Pack],
    progress: Progress = NULL_PROGRESS,
    teacher: bool = False,
    int8_prompts: bool = False,
) -> PassResult:
    """Quantize every planned linear with its algorithm (`plan.algorithms`) on the `calibration` sequences and
    their recorded input statistics, writing each block's tensors as it is done; measure on `eval_packs`. With
    `teacher`, the FP32 model's hidden states of the calibration rows are carried too (distillation's teacher);
    with `int8_prompts`, the held-out rows also pass the quantized blocks with prefill dtype int8 (the opt-in
    prompt path whose KL the manifest records)."""
    packs = make_packs(calibration, 512, share_prefix=True)
    run = _Run(blocks, plan, stats, int(sum(p.represented_tokens for p in packs)))
    info: dict[str, dict[str, Any]] = {}
    groups = input_groups(blocks.model)
    with torch.inference_mode():
        hidden = [blocks.embed(p) for p in packs]
        reference = [blocks.embed(p) for p in eval_packs]
    candidate = list(reference)
    candidate_int8 = list(reference) if int8_prompts else None
    carry = run.learns_rounding or teacher
    fp_hidden = list(hidden) if carry else []
    title = f"Quantizing {blocks.num_layers} blocks on {run.num_tokens:,} calibration tokens"
    with progress.task(title, total=blocks.num_layers) as task, blocks.without_outside():
        for index in range(blocks.num_layers):
            with blocks.block(index):
                with torch.inference_mode():
                    reference = [
                        blocks.run_block(index, h, p) for h, p in zip(reference, eval_packs, strict=True)
                    ]
                    if carry:
                        fp_hidden = [
                            blocks.run_block(index, h, p) for h, p in zip(fp_hidden, packs, strict=True)
                        ]
                block_groups = [g for g in groups if g.block == index]
                records = _quantize_block(run, index, block_groups, hidden, packs, fp_hidden)
                with torch.inference_mode():
                    hidden = [blocks.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
                _write_block(run, index, records, writer, info)
                with torch.inference_mode():
                    candidate = [
                        blocks.run_block(index, h, p) for h, p in zip(candidate, eval_packs, strict=True)
                    ]
                    if candidate_int8 is not None:
                        with prefill_dtype_set(blocks.model, "int8"):
                            candidate_int8 = [
                                blocks.run_block(index, h, p)
                                for h, p in zip(candidate_int8, eval_packs, strict=True)
                            ]
            task.advance()
    result = _finish_outside_blocks(run, writer, info, hidden, packs, reference, candidate)
    if candidate_int8 is not None:
        with torch.inference_mode():
            result.candidate_int8 = [blocks.norm(h)[0] for h in candidate_int8]
    if teacher:
        with torch.inference_mode():
            result.teacher = [blocks.norm(h)[0] for h in fp_hidden]
    return result


def _write_block(
    run: _Run,
    index: int,
    records: dict[str, QuantizedWeight],
    writer: ArtifactWriter,
    info: dict[str, dict[str, Any]],
) -> None:
    """The block's FP tensors (norms, kept linears) and quantized linears into the artifact; the quantized
    linears then run as their runtime modules for the held-out measurement."""
    prefix = f"model.layers.{index}."
    layer = run.blocks.layers[index]
    owned = tuple(f"{fqn[len(prefix) :]}." for fqn in records)
    writer.add_fp({prefix + n: t for n, t in layer.state_dict().items() if not n.startswith(owned)})
    for fqn, record in records.items():
        writer.add_quantized(fqn, record, run.plan.shapes[fqn])
        if record.info:
            info[fqn] = record.info
        install(run.blocks.model, fqn, record)


def _quantize_block(
    run: _Run,
    index: int,
    block_groups: list[InputGroup],
    hidden: list[torch.Tensor],
    packs: list[Pack],
    targets: list[torch.Tensor],
) -> dict[str, QuantizedWeight]:
    """The block's planned linears quantized; `targets`: the FP32 block's outputs (only AutoRound reads them)."""
    planned = {m for g in block_groups for m in g.members if run.plan.schemes.get(m) is not None}
    needs = any(_needs_hessian(run.plan.algorithms[m]) for m in planned)
    model = run.blocks.model
    heads = {g.name: get_module(model, g.members[0]) for g in block_groups}
    hessians = input_hessians(run.blocks, index, heads, hidden, packs) if needs else {}
    smooth: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    records: dict[str, QuantizedWeight] = {}
    learned: dict[str, tuple[Scheme, torch.Tensor, torch.Tensor | None]] = {}
    with torch.no_grad():
        for group in block_groups:
            members = [m for m in group.members if m in planned]
            if members:
                _fold_group_scale(run, group, members, hessians, smooth, info)
        for group in block_groups:
            records.update(_quantize_group(run, group, hessians.pop(group.name, None), smooth, info, learned))
    if learned:
        records.update(_learn_rounding(run, index, learned, hidden, targets, packs))
    return records


def _needs_hessian(algorithm: A.Algorithm) -> bool:
    if isinstance(algorithm, A.AutoRound):
        return algorithm.init == "gptq"
    return not isinstance(algorithm, A.RTN)


def _gptq_settings(algorithm: A.Algorithm | None) -> A.GPTQ | None:
    """The GPTQ settings a layer's algorithm runs GPTQ with (itself, or AutoRound's start), if any."""
    if isinstance(algorithm, A.GPTQ):
        return algorithm
    if isinstance(algorithm, A.AutoRound) and algorithm.init == "gptq":
        return algorithm.gptq
    return None


def _fold_group_scale(
    run: _Run,
    group: InputGroup,
    members: list[str],
    hessians: dict[str, torch.Tensor],
    smooth: dict[str, torch.Tensor],
    info: dict[str, dict[str, Any]],
) -> None:
    """SmoothQuant's or AWQ's per-input-channel scale for one input group, folded into the module in front of
    it (or, with nothing to fold into, kept for the w8a8 members in `smooth`); the group's Hessian follows."""
    plan, model = run.plan, run.blocks.model
    smoothquant = _first(A.SmoothQuant, [plan.algorithms[m] for m in members])
    awq = _first(A.AWQ, [plan.algorithms[m] for m in members])
    weights = [get_linear(model, m).weight.detach().to(torch.float32) for m in group.members]
    h = hessians.get(group.name)
    scale: torch.Tensor | None = None
    if smoothquant is not None:
        stat = run.stats.get(group.members[0])
        if stat is not None:
            abs_max = stat.abs_max
        else:
            assert h is not None, "the Hessian is collected for every non-RTN group"
            abs_max = torch.diag(h).sqrt()
        scale = A.smoothquant_factor(weights, abs_max, smoothquant.alpha)
        for m in members:
            info.setdefault(m, {})["smoothquant_alpha"] = smoothquant.alpha
    elif awq is not None and group.predecessor is not None and h is not None:
        schemes = [
            plan.schemes.get(m) if isinstance(plan.algorithms.get(m), A.AWQ) else None for m in group.members
        ]
        rms = _input_rms(run.stats, group.members[0], h, run.num_tokens)
        scale, alpha = A.awq_search(weights, schemes, h, rms, awq)
        for m in members:
            info.setdefault(m, {})["awq_alpha"] = alpha
    if scale is None:
        return
    if group.predecessor is not None:
        fold_input_scale(model, group, scale)
        if h is not None:
            hessians[group.name] = h / scale[:, None] / scale[None, :]
        return
    for m in members:
        if isinstance(plan.schemes[m], W8A8):
            smooth[m] = scale
            get_linear(model, m).weight.mul_(scale[None, :])


def _input_rms(
    stats: dict[str, ChannelStats], fqn: str, hessian: torch.Tensor | None, tokens: int
) -> torch.Tensor:
    if fqn in stats:
        return stats[fqn].mean_sq.to(torch.float32).clamp_min(0).sqrt()
    assert hessian is not None
    return (torch.diag(hessian) / max(tokens, 1)).clamp_min(0).sqrt()


def _quantize_group(
    run: _Run,
    group: InputGroup,
    hessian: torch.Tensor | None,
    smooth: dict[str, torch.Tensor],
    info: dict[str, dict[str, Any]],
    learned: dict[str, tuple[Scheme, torch.Tensor, torch.Tensor | None]],
) -> dict[str, QuantizedWeight]:
    """Each planned member of one input group with GPTQ (sharing one prepared Hessian) or RTN; AutoRound's
    members go to `learned` (their weight, and GPTQ's result when learning starts from it) instead."""
    records: dict[str, QuantizedWeight] = {}
    gptq = {
        fqn: settings
        for fqn in group.members
        if (settings := _gptq_settings(run.plan.algorithms.get(fqn))) is not None
        and isinstance(run.plan.schemes.get(fqn), Int8 | Int4 | W8A8)
    }
    settings = next(iter(gptq.values()), None)  # one requested algorithm: the same settings for every member
    prepared = A.prepare_hessian(hessian, settings) if settings is not None and hessian is not None else None
    del hessian  # GPTQ needs only the prepared inverse factor: one K x K matrix alive, not two
    for fqn in group.members:
        scheme = run.plan.schemes.get(fqn)
        if scheme is None:
            continue
        linear = get_linear(run.blocks.model, fqn)
        algorithm = run.plan.algorithms[fqn]
        weight = linear.weight.detach().to(torch.float32)
        if isinstance(algorithm, A.AutoRound) and isinstance(scheme, Int8 | Int4):
            start = None
            if fqn in gptq and prepared is not None:
                start = handler_for(scheme).dequantize(
                    scheme, A.quantize_gptq(scheme, weight, prepared, gptq[fqn])
                )
            learned[fqn] = (scheme, weight, start)
            continue
        if fqn in gptq and prepared is not None:
            tensors = A.quantize_gptq(scheme, weight, prepared, gptq[fqn])
        else:
            tensors = A.quantize_rtn(scheme, weight)
        if fqn in smooth:
            tensors["smooth"] = smooth[fqn].to(torch.float32)
        records[fqn] = QuantizedWeight(scheme, algorithm.name, tensors, _bias(linear), info.get(fqn, {}))
        linear.weight.copy_(handler_for(scheme).dequantize(scheme, tensors).to(linear.weight.dtype))
    return records


def _learn_rounding(
    run: _Run,
    index: int,
    learned: dict[str, tuple[Scheme, torch.Tensor, torch.Tensor | None]],
    hidden: list[torch.Tensor],
    targets: list[torch.Tensor],
    packs: list[Pack],
) -> dict[str, QuantizedWeight]:
    """AutoRound over the block's learned linears together: the block with their fake-quantized weights, on the
    quantized model's inputs, against the FP32 block's outputs on the FP32 model's inputs (position-weighted
    MSE), a batch of whole packed rows per step. The hidden states were made in inference mode: a step copies
    only its batch's inputs (autograd saves them), so the pass holds no second copy of the calibration set."""
    settings = next(a for fqn in learned if isinstance(a := run.plan.algorithms[fqn], A.AutoRound))
    prefix = f"model.layers.{index}."
    roundings = {fqn: A.init_rounding(*learned[fqn]) for fqn in learned}
    batches = _batches(packs, settings.batch_tokens, settings.iters + 1, settings.seed + index)
    with run.blocks.block(index) as layer:
        frozen = [p for p in layer.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        ropes = [
            tuple(t.clone() for t in run.blocks.rope(p, h[:1])) for h, p in zip(hidden, packs, strict=True)
        ]

        def loss(weights: dict[str, torch.Tensor], step: int) -> Iterator[torch.Tensor]:
            local = {f"{fqn[len(prefix) :]}.weight": w for fqn, w in weights.items()}
            rows = batches[step]
            norm = max(1.0, sum(float(packs[i].weights.sum()) * hidden[i].shape[-1] for i in rows))
            for i in rows:
                pack = packs[i]
                out = torch.func.functional_call(
                    layer,
                    local,
                    (hidden[i].clone(),),
                    {
                        "attention_mask": pack.mask,
                        "position_ids": pack.position_ids,
                        "position_embeddings": ropes[i],
                    },
                )
                out = out[0] if isinstance(out, tuple) else out
                error = (out - targets[i]).pow(2).sum(dim=-1)[0]
                yield (error * pack.weights).sum() / norm

        try:
            with torch.enable_grad():
                result = A.learn_rounding(roundings, loss, settings)
        finally:
            for p in frozen:
                p.requires_grad_(True)
    records: dict[str, QuantizedWeight] = {}
    with torch.no_grad():
        for fqn, rounding in roundings.items():
            scheme = rounding.scheme
            tensors = A.best_tensors(rounding)
            linear = get_linear(run.blocks.model, fqn)
            info = {"autoround_init": settings.init, **result.to_info()}
            records[fqn] = QuantizedWeight(scheme, settings.name, tensors, _bias(linear), info)
            linear.weight.copy_(handler_for(scheme).dequantize(scheme, tensors).to(linear.weight.dtype))
    return records


def _batches(packs: list[Pack], tokens: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` batches of pack indices, each whole rows adding up to about `tokens`, every pack once per epoch
    in a seeded order."""
    next_batch = row_batches(packs, list(range(len(packs))), tokens, random.Random(seed))
    return [next_batch() for _ in range(steps)]


def _finish_outside_blocks(
    run: _Run,
    writer: ArtifactWriter,
    info: dict[str, dict[str, Any]],
    hidden: list[torch.Tensor],
    packs: list[Pack],
    reference: list[torch.Tensor],
    candidate: list[torch.Tensor],
) -> PassResult:
    """The weights outside the blocks: the LM head quantized only when an override asks (GPTQ on the final
    normed hidden states, else RTN), everything else FP32; then the held-out final hidden states normed."""
    blocks, model = run.blocks, run.blocks.model
    reference_head = candidate_head = blocks.lm_head
    quantized: dict[str, QuantizedWeight] = {}
    for fqn, scheme in run.plan.quantized().items():
        if fqn.startswith("model.layers."):
            continue
        linear = get_linear(model, fqn)
        weight = linear.weight.detach().to(torch.float32)
        algorithm = run.plan.algorithms[fqn]
        if isinstance(algorithm, A.GPTQ) and isinstance(scheme, Int8 | Int4 | W8A8) and fqn == "lm_head":
            with torch.inference_mode():
                normed = [
                    blocks.norm(h)[0] * p.weights[:, None].sqrt() for h, p in zip(hidden, packs, strict=True)
                ]
            x = torch.cat(normed)
            tensors = A.quantize_gptq(scheme, weight, x.t() @ x, algorithm)
        else:
            tensors = A.quantize_rtn(scheme, weight)
        quantized[fqn] = QuantizedWeight(scheme, algorithm.name, tensors, _bias(linear))
    outside = {n: t for n, t in model.state_dict().items() if not n.startswith("model.layers.")}
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" not in quantized:
        outside.pop("lm_head.weight", None)  # stored once, as the embedding
    owned = tuple(f"{fqn}." for fqn in quantized)
    writer.add_fp({n: t for n, t in outside.items() if not n.startswith(owned)})
    for fqn, record in quantized.items():
        writer.add_quantized(fqn, record, run.plan.shapes[fqn])
        module = install(model, fqn, record)
        if fqn == "lm_head":
            candidate_head = module
    with torch.inference_mode():
        reference = [blocks.norm(h)[0] for h in reference]
        candidate = [blocks.norm(h)[0] for h in candidate]
    return PassResult(info, reference, candidate, reference_head, candidate_head, packs, [])


T = TypeVar("T", bound=A.Algorithm)


def _first(kind: type[T], algorithms: list[A.Algorithm]) -> T | None:
    return next((a for a in algorithms if isinstance(a, kind)), None)


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
