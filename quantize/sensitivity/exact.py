"""Exact per-layer KL: each candidate alone in place of its layer, the rest of the model re-run, next-token
distributions compared with the FP32 model's on held-out tokens.

The candidate runs as its real runtime module, so kernel numerics count too. Cost is kept down without
approximating: block inputs of the FP32 model are cached, so a candidate in block b re-runs blocks b..L only; all
candidates of a block run the tail together as one batch; and the KL against a fixed reference is computed from
the small logit difference `dz = W (h_q - h_p)` (`kl_to_reference`), chunked over the vocabulary, which keeps fp32
accurate for per-layer KLs down to 1e-9."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from quantize.algorithms.rtn import fake_quant
from quantize.common.progress import Progress
from quantize.formats.primitives import output_error
from quantize.formats.schemes import Scheme
from quantize.model.surgery import get_linear, get_module, input_groups, set_module
from quantize.planning.plan import block_index
from quantize.runtime.handlers import handler_for
from quantize.sensitivity.table import SensitivityTable
from quantize.sequential.packing import Pack
from quantize.sequential.runner import BlockRunner, input_hessians, iter_chunks


def _runtime(scheme: Scheme, linear: nn.Linear) -> nn.Module:
    handler = handler_for(scheme)
    tensors = handler.quantize(scheme, linear.weight.detach())
    bias = None if linear.bias is None else linear.bias.detach()
    return handler.build(scheme, tensors, bias, linear.weight.device)


@dataclass
class ReferenceLogits:
    """What KL against a fixed reference needs, precomputed once per pack.

    With a linear head, the candidate's logits differ from the reference's by dz = W (h_q - h_p) (the bias
    cancels), so exactly KL(p || q) = log(1 + sum_v p_v expm1(dz_v)) - sum_v p_v dz_v, and the second sum is
    (p W) . (h_q - h_p). Working with the small dz instead of subtracting two large log-partition functions
    keeps fp32 accurate for per-layer KLs down to 1e-9, at the cost of one head matmul per candidate.
    hidden: [T, H], probs: [T, V], expected_row: [T, H] (= p W)
    """

    hidden: torch.Tensor
    probs: torch.Tensor
    expected_row: torch.Tensor


def _head_weight(head: nn.Module) -> torch.Tensor:
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError("the head must be a linear layer with a weight")
    return weight


@torch.inference_mode()
def reference_logits(head: nn.Module, hidden: torch.Tensor) -> ReferenceLogits:
    logits = head(hidden).to(torch.float64)
    probs = torch.softmax(logits, dim=-1).to(torch.float32)
    return ReferenceLogits(
        hidden=hidden, probs=probs, expected_row=probs @ _head_weight(head).to(torch.float32)
    )


@torch.inference_mode()
def kl_to_reference(
    head: nn.Module, reference: ReferenceLogits, candidate: torch.Tensor, chunk: int = 256
) -> torch.Tensor:
    """Per-token KL(reference || candidate) for candidate final hidden states [T, H] -> [T]."""
    weight = _head_weight(head).to(torch.float32)
    out = []
    buffer: torch.Tensor | None = None
    for part in iter_chunks(candidate.shape[0], chunk):
        delta = (candidate[part] - reference.hidden[part]).to(torch.float32)  # [t, H]
        rows = delta.shape[0]
        if buffer is None or buffer.shape[0] < rows:
            buffer = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        dz = torch.matmul(delta, weight.t(), out=buffer[:rows])  # [t, V]
        torch.special.expm1(dz, out=dz)
        moment = torch.bmm(reference.probs[part].unsqueeze(1), dz.unsqueeze(2))[:, 0, 0]  # [t]
        cross = (reference.expected_row[part] * delta).sum(-1)
        out.append(torch.log1p(moment.to(torch.float64)) - cross.to(torch.float64))
    return torch.cat(out).clamp_min(0.0).to(torch.float32)


def measure_exact(
    runner: BlockRunner,
    todo: dict[str, list[Scheme]],
    measure: dict[str, list[Scheme]],
    packs: list[Pack],
    table: SensitivityTable,
    progress: Progress,
) -> None:
    """Output error for every candidate in `todo`, exact KL for those in `measure`, block by block."""
    head = runner.lm_head
    blocks = sorted({block_index(f) for f in todo})
    block_inputs: dict[int, list[torch.Tensor]] = defaultdict(list)
    with (
        progress.task("Sensitivity: FP32 reference pass", total=runner.num_layers) as task,
        torch.inference_mode(),
    ):
        hidden = [runner.embed(p) for p in packs]
        for index in range(runner.num_layers):
            if index in blocks:
                block_inputs[index] = hidden
            with runner.block(index):
                hidden = [runner.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
            task.advance()
        reference = [reference_logits(head, runner.norm(h)[0]) for h in hidden]
    num_measured = sum(len(v) for v in measure.values())
    with progress.task(
        f"Sensitivity: {num_measured} exact KL + {sum(len(v) for v in todo.values())} output errors",
        total=len(blocks),
    ) as task:
        for index in blocks:
            with runner.block(index):
                _measure_block(runner, index, todo, measure, packs, block_inputs[index], reference, table)
            del block_inputs[index]
            task.advance()
    runner.forget_rope()


def _measure_block(
    runner: BlockRunner,
    index: int,
    todo: dict[str, list[Scheme]],
    measure: dict[str, list[Scheme]],
    packs: list[Pack],
    inputs: list[torch.Tensor],
    reference: list[ReferenceLogits],
    table: SensitivityTable,
) -> None:
    """One block's candidates: output errors from its input Hessians, then exact KL of the measured ones."""
    model = runner.model
    fqns = [f for f in todo if block_index(f) == index]
    groups = {m: g.name for g in input_groups(model) if g.block == index for m in g.members}
    heads = {g.name: get_module(model, g.members[0]) for g in input_groups(model) if g.block == index}
    hessians = input_hessians(
        runner, index, heads, inputs, packs
    )  # one per input: q/k/v and gate/up share theirs
    for fqn in fqns:
        weight = get_linear(model, fqn).weight.detach().to(torch.float32)
        hessian = hessians[groups[fqn]]
        signal = max(float(output_error(weight, hessian)), 1e-30)
        for scheme in todo[fqn]:
            error = float(output_error(fake_quant(scheme, weight) - weight, hessian))
            table.record(fqn, scheme, mse=error / signal)
    del hessians
    candidates = [(f, s) for f in fqns for s in measure.get(f, [])]
    if candidates:
        _exact_kl(runner, index, candidates, packs, inputs, reference, table)


def _exact_kl(
    runner: BlockRunner,
    index: int,
    candidates: list[tuple[str, Scheme]],
    packs: list[Pack],
    inputs: list[torch.Tensor],
    reference: list[ReferenceLogits],
    table: SensitivityTable,
) -> None:
    """KL from FP32 with each candidate alone in place, re-running the tail (all candidates as one batch)."""
    model, head = runner.model, runner.lm_head
    modules = []
    for fqn, scheme in candidates:
        original = get_linear(model, fqn)
        modules.append((fqn, original, _runtime(scheme, original)))
    totals = [0.0] * len(candidates)
    count = 0.0
    for pack_index, pack in enumerate(packs):
        outputs = []
        for fqn, original, runtime in modules:
            set_module(model, fqn, runtime)
            try:
                outputs.append(runner.run_block(index, inputs[pack_index], pack))
            finally:
                set_module(model, fqn, original)
        normed = runner.run_from(index + 1, torch.cat(outputs, dim=0), pack)
        for row in range(len(candidates)):
            kl = kl_to_reference(head, reference[pack_index], normed[row])
            totals[row] += float((kl * pack.weights).sum())
        count += pack.represented_tokens
    for (fqn, scheme), total in zip(candidates, totals, strict=True):
        table.record(fqn, scheme, kl=total / max(count, 1))
