"""Run a Llama-family model one decoder block at a time over packed sequences.

GPTQ, AWQ, SmoothQuant, the sensitivity analysis and the held-out quality measurement all need the inputs of one
decoder block at a time, not a whole-model forward: it keeps peak memory at about one block's activations, lets
quantization errors of earlier blocks propagate into later blocks' calibration (as they will in deployment), and
lets sensitivity restart the forward at the block being perturbed instead of at the embeddings. The model may be
loaded or streamed (`quantize.sequential.streamed`: a block's weights exist only while it runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from quantize.sequential.packing import Pack
from quantize.sequential.streamed import StreamedModel


class BlockRunner:
    """Block-by-block access to a `*ForCausalLM` of the Llama family, loaded or streamed (`StreamedModel`: a
    block's weights exist only inside `block(i)`; `run_block` materializes it when no caller holds it)."""

    def __init__(self, model: nn.Module | StreamedModel) -> None:
        self.streamed = model if isinstance(model, StreamedModel) else None
        if isinstance(model, StreamedModel):
            model = model.model
        self.model: Any = model  # a Llama-family *ForCausalLM: its modules are reached by name
        base: Any = cast(Any, model).model
        self.embed_tokens: nn.Module = base.embed_tokens
        self.layers: nn.ModuleList = base.layers
        self.norm: nn.Module = base.norm
        self.rotary_emb: nn.Module = base.rotary_emb
        self.lm_head: nn.Module = cast(Any, model).lm_head
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


@torch.inference_mode()
def input_hessians(
    blocks: BlockRunner,
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
            blocks.run_block(index, h, pack)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def iter_chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))
