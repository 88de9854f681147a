"""Activation statistics of every linear layer's input, from one batched forward pass.

AWQ's scale search and SmoothQuant's migration both need, per input channel of each linear layer, how large
the activations get (abs-max) and how much energy they carry (mean square); the sensitivity planner uses them
too. Collecting them takes one forward pass over the calibration tokens with pre-forward hooks. Padding is
excluded through the attention mask, so batching by length changes nothing but speed. The LM head's input is
the final hidden state; it is measured directly instead of computing vocabulary-sized logits that nobody
needs here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quantize.calibdata import ChannelStats
from quantize.progress import NULL_PROGRESS, Progress


class _Accumulator:
    def __init__(self, in_features: int) -> None:
        self.abs_max = torch.zeros(in_features, dtype=torch.float32)
        self.sum_sq = torch.zeros(in_features, dtype=torch.float64)
        self.num_tokens = 0

    def update(self, abs_max: torch.Tensor, sum_sq: torch.Tensor, num_tokens: int) -> None:
        torch.maximum(self.abs_max, abs_max, out=self.abs_max)
        self.sum_sq += sum_sq
        self.num_tokens += num_tokens

    def result(self) -> ChannelStats:
        mean_sq = (self.sum_sq / max(self.num_tokens, 1)).to(torch.float32)
        return ChannelStats(abs_max=self.abs_max.clone(), mean_sq=mean_sq, num_tokens=self.num_tokens)


class ActivationStatsCollector:
    """Hooks every `nn.Linear` of `model`; feed it batches with `collect`, then read `results()`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._mask_size = 0
        self._accumulators: dict[str, _Accumulator] = {}
        self._handles: list[Any] = []
        self._last_input: torch.Tensor | None = None
        self._last_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._valid_rows: torch.Tensor | None = None
        self._scratch: dict[int, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                self._accumulators[name] = _Accumulator(module.in_features)
                self._handles.append(module.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        accumulator = self._accumulators[name]

        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            accumulator.update(*self._reduce(args[0]))

        return hook

    def _buffer(self, rows: int, features: int) -> torch.Tensor:
        """Reused scratch memory: fresh 50 MB temporaries per hook cost more in page faults than the math."""
        buffer = self._scratch.get(features)
        if buffer is None or buffer.shape[0] < rows:
            buffer = torch.empty(rows, features, dtype=torch.float32)
            self._scratch[features] = buffer
        return buffer[:rows]

    def _reduce(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Per-channel (abs-max, sum of squares, tokens) of one input; q/k/v and gate/up share theirs."""
        if x is self._last_input and self._last_stats is not None:
            return self._last_stats
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)  # [batch * seq, in_features]
        if self._valid_rows is not None and flat.shape[0] == self._mask_size:
            flat = torch.index_select(flat, 0, self._valid_rows)  # [valid tokens, in_features]
        work = self._buffer(flat.shape[0], flat.shape[1])
        torch.abs(flat, out=work)
        abs_max = work.amax(dim=0)
        torch.mul(flat, flat, out=work)
        sum_sq = work.sum(dim=0).to(torch.float64)
        stats = (abs_max, sum_sq, flat.shape[0])
        self._last_input, self._last_stats = x, stats
        return stats

    @torch.inference_mode()
    def collect(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        # input_ids, attention_mask: [batch, seq]
        mask = attention_mask.bool().reshape(-1)
        self._mask_size = mask.numel()
        self._valid_rows = None if bool(mask.all()) else mask.nonzero().squeeze(1)
        try:
            base = getattr(self.model, "model", None)
            head = getattr(self.model, "lm_head", None)
            if isinstance(base, nn.Module) and isinstance(head, nn.Linear):
                hidden = base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
                head_name = next(n for n, m in self.model.named_modules() if m is head)
                self._accumulators[head_name].update(*self._reduce(hidden))
            else:
                self.model(input_ids=input_ids, attention_mask=attention_mask)
        finally:
            self._valid_rows = None
            self._last_input = self._last_stats = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def results(self) -> dict[str, ChannelStats]:
        return {name: acc.result() for name, acc in self._accumulators.items()}


def length_batches(lengths: list[int], token_budget: int, max_batch: int = 64) -> Iterator[list[int]]:
    """Indices grouped longest-first so each padded batch stays within `token_budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for index in order:
        longest = lengths[batch[0]] if batch else lengths[index]
        if batch and (longest * (len(batch) + 1) > token_budget or len(batch) >= max_batch):
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


def pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
    return input_ids, attention_mask


def collect_stats(
    model: nn.Module,
    sequences: list[list[int]],
    pad_id: int,
    token_budget: int = 4096,
    progress: Progress = NULL_PROGRESS,
) -> dict[str, ChannelStats]:
    collector = ActivationStatsCollector(model)
    try:
        lengths = [len(s) for s in sequences]
        with progress.task("Activation statistics (forward pass)", total=sum(lengths)) as task:
            for batch in length_batches(lengths, token_budget):
                input_ids, attention_mask = pad_batch([sequences[i] for i in batch], pad_id)
                collector.collect(input_ids, attention_mask)
                task.advance(sum(lengths[i] for i in batch))
    finally:
        collector.close()
    return collector.results()
