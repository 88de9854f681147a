"""Activation statistics of every linear layer's input, block by block.

AWQ's scale search and SmoothQuant's migration both need, per input channel of each linear layer, how large
the activations get (abs-max) and how much energy they carry (mean square); the sensitivity planner uses them
too. The calibration sequences are packed into rows with a block-diagonal causal mask (no padding, so nothing
needs masking out) and carried through the decoder one block at a time, with pre-forward hooks on that block's
linears: a streamed model needs only one block in memory. The LM head's input is the final normed hidden state;
it is measured directly instead of computing vocabulary-sized logits that nobody needs here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.io.calibration import ChannelStats
from quantize.sequential.packing import make_packs
from quantize.sequential.runner import BlockRunner
from quantize.sequential.streamed import StreamedModel

Reduced = tuple[torch.Tensor, torch.Tensor, int]  # per-channel abs-max, sum of squares (float64), tokens


def _reduce(x: torch.Tensor) -> Reduced:
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)  # [tokens, in_features]
    return flat.abs().amax(dim=0), (flat * flat).sum(dim=0).to(torch.float64), flat.shape[0]


class _Accumulator:
    def __init__(self, in_features: int) -> None:
        self.abs_max = torch.zeros(in_features, dtype=torch.float32)
        self.sum_sq = torch.zeros(in_features, dtype=torch.float64)
        self.num_tokens = 0

    def update(self, reduced: Reduced) -> None:
        abs_max, sum_sq, num_tokens = reduced
        torch.maximum(self.abs_max, abs_max, out=self.abs_max)
        self.sum_sq += sum_sq
        self.num_tokens += num_tokens

    def result(self) -> ChannelStats:
        mean_sq = (self.sum_sq / max(self.num_tokens, 1)).to(torch.float32)
        return ChannelStats(abs_max=self.abs_max.clone(), mean_sq=mean_sq, num_tokens=self.num_tokens)


def _hooks(block: nn.Module, prefix: str, accumulators: dict[str, _Accumulator]) -> list[Any]:
    """Pre-forward hooks on a block's linears; linears sharing an input (q/k/v, gate/up) reduce it once."""
    last: dict[str, Any] = {"x": None, "reduced": None}

    def reduced(x: torch.Tensor) -> Reduced:
        if x is not last["x"]:
            last["x"], last["reduced"] = x, _reduce(x)
        return last["reduced"]

    handles = []
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            accumulator = accumulators[prefix + name]
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, args, acc=accumulator: acc.update(reduced(args[0]))
                )
            )
    return handles


@torch.inference_mode()
def collect_stats(
    model: nn.Module | StreamedModel,
    sequences: list[list[int]],
    token_budget: int = 4096,
    progress: Progress = NULL_PROGRESS,
) -> dict[str, ChannelStats]:
    """Per-channel abs-max and mean square of every linear's input over `sequences` (packed `token_budget`
    tokens to a row), one decoder block at a time."""
    blocks = BlockRunner(model)
    accumulators = {
        name: _Accumulator(int(module.in_features))
        for name, module in blocks.model.named_modules()
        if isinstance(module, nn.Linear)
    }
    packs = make_packs([torch.tensor(s, dtype=torch.int64) for s in sequences], token_budget)
    hidden = [blocks.embed(p) for p in packs]
    with (
        progress.task("Activation statistics (block by block)", total=blocks.num_layers) as task,
        blocks.without_outside(),
    ):
        for index in range(blocks.num_layers):
            with blocks.block(index) as block:
                handles = _hooks(block, f"model.layers.{index}.", accumulators)
                try:
                    hidden = [blocks.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
                finally:
                    for handle in handles:
                        handle.remove()
            task.advance()
    head = next(n for n, m in blocks.model.named_modules() if m is blocks.lm_head)
    for h in hidden:
        accumulators[head].update(_reduce(blocks.norm(h)))
    blocks.forget_rope()
    return {name: acc.result() for name, acc in accumulators.items()}
