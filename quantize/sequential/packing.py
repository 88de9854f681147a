"""Calibration and held-out queries packed into rows for block-by-block passes.

Calibration queries are short and of mixed length, so instead of padding they are packed into rows of up to
`max_tokens` with restarting position ids and a block-diagonal causal mask: attention never crosses a query
boundary, so the result is exactly the per-query forward, with matmuls large enough to be efficient. A prefix
every query shares (a chat template's system prompt) can be stored once per row, its positions weighted by the
number of queries they stand for."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Pack:
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    mask: torch.Tensor  # [1, 1, T, T] float32, 0 where attention is allowed, finfo.min elsewhere
    lengths: list[int]  # lengths of the sequences packed after the shared prefix
    weights: torch.Tensor  # [T] float32: how many original sequences each position stands for
    prefix: int = 0  # tokens shared by every sequence of the pack (stored once)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def represented_tokens(self) -> float:
        return float(self.weights.sum())


def common_prefix(sequences: list[torch.Tensor]) -> int:
    """Length of the prefix shared by every sequence, leaving each at least one token of its own."""
    if len(sequences) < 2:
        return 0
    limit = min(len(s) for s in sequences) - 1
    first = sequences[0]
    length = 0
    while length < limit and all(int(s[length]) == int(first[length]) for s in sequences[1:]):
        length += 1
    return length


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for index in order:
        for row, free in enumerate(room):
            if lengths[index] <= free:
                rows[row].append(index)
                room[row] -= lengths[index]
                break
        else:
            rows.append([index])
            room.append(capacity - lengths[index])
    return rows


def make_packs(sequences: list[torch.Tensor], max_tokens: int, share_prefix: bool = False) -> list[Pack]:
    """Pack sequences into rows of at most `max_tokens` (longer ones alone), first-fit decreasing.

    With `share_prefix`, a prefix common to all sequences (a chat template's system prompt) is stored once per
    row and every sequence attends to it: the same activations as running each sequence on its own, with the
    prefix positions weighted by the number of sequences they stand for.
    """
    parts_all = [s.to(torch.int64).reshape(-1) for s in sequences]
    prefix = common_prefix(parts_all) if share_prefix else 0
    if prefix < 4:
        prefix = 0
    suffixes = [p[prefix:] for p in parts_all]
    rows = _first_fit([len(s) for s in suffixes], max(max_tokens - prefix, 1))
    packs = []
    for row in rows:
        parts = [suffixes[i] for i in row]
        lengths = [len(p) for p in parts]
        total = prefix + sum(lengths)
        allowed = torch.zeros(total, total, dtype=torch.bool)
        positions = [torch.arange(prefix)]
        weights = torch.ones(total, dtype=torch.float32)
        if prefix:
            allowed[:prefix, :prefix] = torch.tril(torch.ones(prefix, prefix, dtype=torch.bool))
            weights[:prefix] = float(len(parts))
        start = prefix
        for length in lengths:
            allowed[start : start + length, :prefix] = True
            allowed[start : start + length, start : start + length] = torch.tril(
                torch.ones(length, length, dtype=torch.bool)
            )
            positions.append(torch.arange(prefix, prefix + length))
            start += length
        mask = torch.zeros(total, total, dtype=torch.float32)
        mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
        ids = torch.cat([parts_all[row[0]][:prefix], *parts])
        packs.append(
            Pack(
                input_ids=ids[None, :],
                position_ids=torch.cat(positions)[None, :],
                mask=mask[None, None],
                lengths=lengths,
                weights=weights,
                prefix=prefix,
            )
        )
    return packs


def sample_sequences(
    sequences: list[torch.Tensor], budget: int, seed: int, truncate: bool = False
) -> list[torch.Tensor]:
    """A seeded random subset of sequences totalling about `budget` tokens (the last one cut to fit if `truncate`)."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    chosen: list[torch.Tensor] = []
    total = 0
    for index in order:
        if total >= budget:
            break
        sequence = sequences[index][: max(2, budget - total)] if truncate else sequences[index]
        chosen.append(sequence)
        total += len(sequence)
    return chosen


def next_token_targets(pack: Pack) -> torch.Tensor:
    """Target id for each position of a pack (the next token of the same sequence), -1 at sequence ends."""
    if pack.prefix:
        raise ValueError(
            "next-token targets are ambiguous at the end of a shared prefix; pack without sharing"
        )
    targets = torch.full((pack.num_tokens,), -1, dtype=torch.int64)
    ids = pack.input_ids[0]
    start = 0
    for length in pack.lengths:
        targets[start : start + length - 1] = ids[start + 1 : start + length]
        start += length
    return targets


def row_batches(
    packs: list[Pack], rows: list[int], tokens: int, rng: random.Random
) -> Callable[[], list[int]]:
    """A source of batches: whole rows of `rows` adding up to about `tokens` each, every row once per epoch in
    an order shuffled by `rng`."""
    order: list[int] = []

    def next_batch() -> list[int]:
        batch: list[int] = []
        size = 0
        while size < tokens and len(batch) < len(rows):
            if not order:
                order.extend(rows)
                rng.shuffle(order)
            row = order.pop()
            if row in batch:
                order.insert(0, row)
                break
            batch.append(row)
            size += packs[row].num_tokens
        return batch

    return next_batch
