"""Sensitivity that scales: every layer's KL cost estimated from one forward and one backward pass.

Exact per-layer KL (quantize one layer, re-run the rest of the model, compare next-token distributions) costs a
tail forward per layer and candidate: minutes on a 135M model, hours at 7B, and with a streamed model every tail
re-reads blocks from disk. The second-order expansion of the same quantity needs no per-layer forward:

    KL(p || p_dW) ~ 1/2 E_x[ (d log p(y|x) / dy_out . dW x)^2 ],  y ~ p(.|x)

where `dW x` is the change the quantized weight makes to the layer's output and the expectation runs over
labels sampled from the model itself, which makes it the Fisher information of the output distribution, the
exact curvature of KL at dW = 0 (not the "empirical Fisher" of the data labels). Summed over a sequence's
positions (a weight perturbation moves every position's logits, and the cross terms matter), averaged over
`samples` label draws per position and divided by the tokens, it estimates the same per-token KL the exact
method measures. So one forward pass keeps each block's input, the sampled labels' log-likelihood gradient is
back-propagated block by block from the head (each block re-run with autograd once, for all label draws
together as a batch), and at each linear every candidate's `dW` is scored with the captured input and output
gradient: a matrix product per candidate, no forward per candidate.

On SmolLM2-135M (210 linears, int4-g64) this estimate ranks layers with Spearman 0.92 against exact KL, and its
median ratio to exact KL is 1.00 (the relative output error `tr(dW H dW^T) / tr(W H W^T)`, the cheap proxy before,
ranks them at 0.48). With a streamed model each block is read twice in all (forward, backward).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantize.algorithms import fake_quant
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.formats.schemes import Scheme
from quantize.model.surgery import get_linear
from quantize.sequential.packing import Pack
from quantize.sequential.runner import BlockRunner


def fisher_kl(
    blocks: BlockRunner,
    candidates: dict[str, list[Scheme]],
    packs: list[Pack],
    samples: int = 4,
    seed: int = 0,
    progress: Progress = NULL_PROGRESS,
) -> dict[str, list[float]]:
    """{fqn: estimated per-token KL of each candidate scheme (in `candidates[fqn]`'s order)}.

    `packs` must not share a prefix between sequences (each position stands for one token)."""
    if any(p.prefix for p in packs):
        raise ValueError("fisher_kl needs packs without a shared prefix")
    totals = {fqn: [0.0] * len(schemes) for fqn, schemes in candidates.items()}
    generator = torch.Generator().manual_seed(seed)
    inputs = _forward(blocks, packs, progress)  # inputs[b][p]: block b's input on pack p
    grads = [_head_gradient(blocks, h, samples, generator) for h in inputs[blocks.num_layers]]
    with (
        progress.task("Sensitivity (Fisher): backward pass", total=blocks.num_layers) as task,
        blocks.without_outside(),
    ):
        for index in reversed(range(blocks.num_layers)):
            prefix = f"model.layers.{index}."
            mine = {
                fqn[len(prefix) :]: schemes for fqn, schemes in candidates.items() if fqn.startswith(prefix)
            }
            with blocks.block(index) as block:
                for pack_index, pack in enumerate(packs):
                    scores, grads[pack_index] = _block_backward(
                        blocks, block, pack, inputs[index][pack_index], grads[pack_index], mine
                    )
                    for name, values in scores.items():
                        for slot, value in enumerate(values):
                            totals[prefix + name][slot] += value / (2 * samples)
            inputs[index] = []
            task.advance()
    tokens = sum(p.num_tokens for p in packs)
    return {fqn: [value / tokens for value in values] for fqn, values in totals.items()}


@torch.inference_mode()
def _forward(blocks: BlockRunner, packs: list[Pack], progress: Progress) -> list[list[torch.Tensor]]:
    hidden = [blocks.embed(p) for p in packs]
    inputs = [hidden]
    with (
        progress.task("Sensitivity (Fisher): forward pass", total=blocks.num_layers) as task,
        blocks.without_outside(),
    ):
        for index in range(blocks.num_layers):
            with blocks.block(index):
                hidden = [blocks.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
            inputs.append(hidden)
            task.advance()
    return inputs


def _head_gradient(
    blocks: BlockRunner, final: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """d/d(final hidden) of the log-likelihood of labels drawn from the model itself, `samples` draws:
    [1, T, H] -> [samples, T, H]; logits are formed a chunk of positions at a time."""
    hidden = final.detach().clone().expand(samples, -1, -1).contiguous().requires_grad_(True)
    grad = torch.zeros_like(hidden)
    with torch.enable_grad():
        for start in range(0, hidden.shape[1], 128):
            part = hidden[:, start : start + 128].detach().requires_grad_(True)
            logp = torch.log_softmax(blocks.lm_head(blocks.norm(part)).float(), -1)  # [S, t, V]
            labels = torch.multinomial(logp[0].detach().exp(), samples, replacement=True, generator=generator)
            picked = logp.gather(2, labels.t()[:, :, None])  # [S, t, 1]: draw s at each position
            picked.sum().backward()
            assert part.grad is not None
            grad[:, start : start + 128] = part.grad
    return grad


def _block_backward(
    blocks: BlockRunner,
    block: nn.Module,
    pack: Pack,
    block_input: torch.Tensor,
    grad_output: torch.Tensor,
    candidates: dict[str, list[Scheme]],
) -> tuple[dict[str, list[float]], torch.Tensor]:
    """Re-run one block with autograd for all label draws, back-propagate `grad_output` [S, T, H]; score each
    candidate of each linear; return the scores and the gradient at the block's input."""
    samples = grad_output.shape[0]
    captured: dict[str, dict[str, torch.Tensor]] = {}
    trainable = [p for p in block.parameters() if p.requires_grad]
    for parameter in trainable:  # gradients for the activations only, never a copy of the weights
        parameter.requires_grad_(False)
    handles = [
        module.register_forward_hook(_capture(captured, name))
        for name, module in block.named_modules()
        if name in candidates
    ]
    try:
        with torch.enable_grad():
            x = block_input.detach().clone().expand(samples, -1, -1).contiguous().requires_grad_(True)
            rope = blocks.rotary_emb(x[:1], pack.position_ids)
            out = block(x, attention_mask=pack.mask, position_ids=pack.position_ids, position_embeddings=rope)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad_output)
    finally:
        for handle in handles:
            handle.remove()
        for parameter in trainable:
            parameter.requires_grad_(True)
    assert x.grad is not None
    scores = {
        name: _scores(get_linear(block, name), captured[name], schemes, pack)
        for name, schemes in candidates.items()
    }
    return scores, x.grad.detach()


def _capture(captured: dict[str, dict[str, torch.Tensor]], name: str) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        output.retain_grad()
        captured[name] = {"input": args[0], "output": output}

    return hook


@torch.no_grad()
def _scores(
    linear: nn.Linear, captured: dict[str, torch.Tensor], schemes: list[Scheme], pack: Pack
) -> list[float]:
    """Sum over sequences and draws of (sum over positions of g . dW x)^2, for each candidate's dW."""
    x = captured["input"][0].to(torch.float32)  # [T, K]: every draw saw the same input
    gradient = captured["output"].grad
    assert gradient is not None
    g = gradient.to(torch.float32)  # [S, T, N]
    weight = linear.weight.detach().to(torch.float32)
    bounds = torch.tensor([0, *pack.lengths]).cumsum(0).tolist()
    scores = []
    for scheme in schemes:
        dy = x @ (fake_quant(scheme, weight) - weight).t()  # [T, N]: the output change at each position
        per_position = (g * dy).sum(-1)  # [S, T]
        per_sequence = torch.stack([per_position[:, a:b].sum(-1) for a, b in itertools.pairwise(bounds)])
        scores.append(float((per_sequence.double() ** 2).sum()))
    return scores
