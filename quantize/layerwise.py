"""Run a Llama-family model one decoder block at a time over packed calibration sequences.

GPTQ, AWQ, SmoothQuant and the sensitivity analysis all need the inputs of one decoder block at a time, not a
whole-model forward: it keeps peak memory at about one block's activations, lets quantization errors of
earlier blocks propagate into later blocks' calibration (as they will in deployment), and lets sensitivity
restart the forward at the block being perturbed instead of at the embeddings.

Calibration queries are short and of mixed length, so instead of padding they are packed into rows of up to
`max_tokens` with restarting position ids and a block-diagonal causal mask: attention never crosses a query
boundary, so the result is exactly the per-query forward, with matmuls large enough to be efficient.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantize.streamed import StreamedModel


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


class LayerwiseModel:
    """Block-by-block access to a `*ForCausalLM` of the Llama family, loaded or streamed (`StreamedModel`: a
    block's weights exist only inside `block(i)`; `run_block` materializes it when no caller holds it)."""

    def __init__(self, model: nn.Module | StreamedModel) -> None:
        self.streamed = model if isinstance(model, StreamedModel) else None
        if isinstance(model, StreamedModel):
            model = model.model
        self.model = model
        base = model.model  # type: ignore[attr-defined]
        self.embed_tokens: nn.Module = base.embed_tokens
        self.layers: nn.ModuleList = base.layers
        self.norm: nn.Module = base.norm
        self.rotary_emb: nn.Module = base.rotary_emb
        self.lm_head: nn.Module = model.lm_head  # type: ignore[attr-defined]
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def without_outside(self) -> contextlib.AbstractContextManager[None]:
        """For the duration, a streamed model holds no embedding or head matrix (read again after)."""
        if self.streamed is None:
            return contextlib.nullcontext()
        return _outside_released(self.streamed)

    def block(self, index: int) -> contextlib.AbstractContextManager[nn.Module]:
        """Block `index` ready to run for the duration (streamed: read from disk once, dropped after)."""
        if self.streamed is not None:
            return self.streamed.block(index)
        return contextlib.nullcontext(self.layers[index])

    @torch.inference_mode()
    def embed(self, pack: Pack) -> torch.Tensor:
        return self.embed_tokens(pack.input_ids)  # [1, T, H]

    def rope(self, pack: Pack, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(pack)
        if key not in self._rope:
            self._rope[key] = self.rotary_emb(hidden, pack.position_ids)
        return self._rope[key]

    @torch.inference_mode()
    def run_block(self, index: int, hidden: torch.Tensor, pack: Pack) -> torch.Tensor:
        """hidden [B, T, H] -> [B, T, H]; B > 1 runs several variants of the same pack at once."""
        with self.block(index) as layer:
            out = layer(
                hidden,
                attention_mask=pack.mask,
                position_ids=pack.position_ids,
                position_embeddings=self.rope(pack, hidden[:1]),
            )
        return out[0] if isinstance(out, tuple) else out

    @torch.inference_mode()
    def run_blocks(self, hidden: list[torch.Tensor], packs: list[Pack], start: int = 0) -> list[torch.Tensor]:
        """Every pack through blocks `start..end` (each block materialized once for all packs), no final norm."""
        for index in range(start, self.num_layers):
            with self.block(index):
                hidden = [self.run_block(index, h, p) for h, p in zip(hidden, packs, strict=True)]
        return hidden

    @torch.inference_mode()
    def run_from(self, start: int, hidden: torch.Tensor, pack: Pack) -> torch.Tensor:
        """Blocks `start..end` then the final norm: hidden [B, T, H] -> normed [B, T, H]."""
        for index in range(start, self.num_layers):
            hidden = self.run_block(index, hidden, pack)
        return self.norm(hidden)

    @torch.inference_mode()
    def final_hidden(self, pack: Pack) -> torch.Tensor:
        return self.run_from(0, self.embed(pack), pack)

    def forget_rope(self) -> None:
        self._rope.clear()


@contextlib.contextmanager
def _outside_released(streamed: StreamedModel) -> Iterator[None]:
    streamed.release_outside()
    try:
        yield
    finally:
        streamed.restore_outside()


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


@torch.inference_mode()
def input_hessians(
    lw: LayerwiseModel,
    index: int,
    modules: dict[str, nn.Module],
    hidden: list[torch.Tensor],
    packs: list[Pack],
) -> dict[str, torch.Tensor]:
    """H = sum over tokens of w_t x_t x_t^T for the input x of each given module of block `index`.

    Runs the block once per pack; modules reading the same input (q/k/v, gate/up) share one product, and each
    position is weighted by how many original sequences it stands for (shared prefixes).
    """
    hessians: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {"weights": None}

    def make_hook(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            flat = args[0].reshape(-1, args[0].shape[-1]).to(torch.float32)
            if name not in hessians:
                hessians[name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32)
            hessians[name].addmm_((flat * state["weights"][:, None]).t(), flat)  # in place: K x K once

        return hook

    handles = [module.register_forward_pre_hook(make_hook(name)) for name, module in modules.items()]
    try:
        for h, pack in zip(hidden, packs, strict=True):
            state["weights"] = pack.weights
            lw.run_block(index, h, pack)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def iter_chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


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
