"""A Hugging Face causal LM whose decoder blocks stay on disk until a pass needs them.

Every pass qpack makes over a model (activation statistics, GPTQ/AWQ/SmoothQuant, sensitivity, held-out
quality) walks the decoder blocks in order and needs one block's weights at a time. So instead of loading the
model (an 8B model is 32 GB in FP32 before anything runs), the module tree is built on the `meta` device from
config.json, the parts every pass needs (embeddings, final norm, LM head: FP32 by the product's rule) are read
once, and `block(i)` reads block i from the checkpoint's shards, upcast to FP32 only while it is in use, and
drops it after. With a `rotation` (`--rotate`), each part is rotated as it is read, so every pass sees the
rotated model without it ever being whole in memory. Peak memory is then embeddings + head + the blocks in use (two at most in any qpack pass) + the
pass's activations, independent of depth. `peak_blocks` counts what was materialized at once, so tests can
assert the bound by counting rather than timing.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.common.errors import QpackError
from quantize.common.memory import available_memory
from quantize.io.checkpoint import Checkpoint
from quantize.rotation.absorb import Rotation, rotate_block, rotate_outside

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


class StreamedModel:
    """`model`: the full module tree, blocks on `meta` until `block(i)` materializes them."""

    def __init__(
        self, folder: Path, device: str | torch.device = "cpu", rotation: Rotation | None = None
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from quantize.model.sources import quiet_transformers

        quiet_transformers()
        self.folder = Path(folder)
        self.device = torch.device(device)
        self.checkpoint = Checkpoint(self.folder, "weights file", "re-download or re-convert the model")
        config = AutoConfig.from_pretrained(str(self.folder))
        with torch.device("meta"):
            self.model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model.eval()
        self.rotation = rotation
        self.source_tied = bool(getattr(config, "tie_word_embeddings", False))
        self.layers: nn.ModuleList = self.model.model.layers
        self._templates = [copy.deepcopy(layer) for layer in self.layers]
        self._users = [0] * len(self.layers)
        self.peak_blocks = 0
        self.loads = 0
        self.outside_released = False
        self._check_names()
        self._load_resident()

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def materialized(self) -> int:
        return sum(1 for users in self._users if users)

    def _tied(self) -> bool:
        """Whether the checkpoint stores the head as the embedding (once)."""
        return self.source_tied

    def _check_names(self) -> None:
        """Strict: the checkpoint holds exactly the tensors the architecture has (a tied head stored once)."""
        expected = set(self.model.state_dict())
        if self._tied():
            expected.discard("lm_head.weight")
        present = set(self.checkpoint.refs)
        ignored = [
            re.compile(p) for p in getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or ()
        ]
        unexpected = sorted(n for n in present - expected if not any(p.search(n) for p in ignored))
        missing = sorted(expected - present)
        problems = [
            f"{len(names)} tensors {label} (e.g. {', '.join(names[:3])})"
            for names, label in (
                (missing, "missing from the weights"),
                (unexpected, "not part of the architecture"),
            )
            if names
        ]
        if problems:
            raise QpackError(
                f"model folder {self.folder} does not match its config.json: {'; '.join(problems)}; re-download or "
                "re-convert the model"
            )

    @torch.inference_mode(False)  # plain tensors, usable by autograd (the Fisher pass) whoever asks
    def _load_resident(self) -> None:
        """Everything outside the decoder blocks, in FP32: embeddings, final norm, head, rotary tables."""
        names = [n for n in self.checkpoint.refs if not _BLOCK.match(n)]
        for name in names:
            self._assign(self.model, name, self.checkpoint.read(name, torch.float32))
        base = self.model.model
        if self._tied():
            self.model.lm_head.weight = base.embed_tokens.weight
        if self.rotation is not None:
            rotate_outside(self.model, self.rotation)
        base.rotary_emb = type(base.rotary_emb)(config=self.config).to(self.device)

    def release_outside(self) -> None:
        """Drop the embedding and head matrices (FP32: 1.6 GB at 8B widths) while only the blocks are needed, e.g.
        after the embeddings of a pass's tokens are taken; `restore_outside` reads them again."""
        base = self.model.model
        for module in {id(m): m for m in (base.embed_tokens, self.model.lm_head)}.values():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None and parameter.dim() == 2:
                    module._parameters[name] = nn.Parameter(
                        torch.empty(parameter.shape, device="meta"), requires_grad=False
                    )
        self.outside_released = True

    def restore_outside(self) -> None:
        if self.outside_released:
            self._load_resident()
            self.outside_released = False

    def _assign(self, root: nn.Module, name: str, tensor: torch.Tensor) -> None:
        assign_tensor(root, name, tensor.to(self.device))

    def resident_bytes(self) -> int:
        """Bytes held for the whole run: the FP32 tensors outside the blocks (a tied head counted once)."""
        seen: set[int] = set()
        total = 0
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if tensor.is_meta or name.startswith("model.layers.") or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
        return total

    def needed_bytes(self, activation_tokens: int) -> int:
        """What a qpack pass needs at its peak: the resident tensors, two FP32 blocks (the one in use and the
        next being read), the input Hessians of one block (GPTQ/AWQ, with the inverse of the largest), and the
        activations carried between blocks plus one block's intermediates on a 512-token row."""
        config = self.config
        hidden, intermediate = int(config.hidden_size), int(config.intermediate_size)
        hessians = 4 * (3 * hidden**2 + 2 * intermediate**2)
        activations = 4 * hidden * activation_tokens + 4 * 512 * (4 * intermediate + 4 * hidden)
        return self.resident_bytes() + 2 * self.block_bytes(0) + hessians + activations

    def block_bytes(self, index: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes block `index` takes materialized in `dtype`."""
        element = torch.empty(0, dtype=dtype).element_size()
        return sum(p.numel() * element for p in self._templates[index].parameters())

    @contextmanager
    def block(self, index: int) -> Iterator[nn.Module]:
        """Block `index` with real FP32 weights for the duration; nested uses share one copy."""
        if self._users[index] == 0:
            self._materialize(index)
        self._users[index] += 1
        try:
            yield self.layers[index]
        finally:
            self._users[index] -= 1
            if self._users[index] == 0:
                self.layers[index] = copy.deepcopy(self._templates[index])

    @torch.inference_mode(False)
    def _materialize(self, index: int) -> None:
        layer = copy.deepcopy(self._templates[index])
        prefix = f"model.layers.{index}."
        for name in self.checkpoint.names(prefix):
            self._assign(layer, name[len(prefix) :], self.checkpoint.read(name, torch.float32))
        if self.rotation is not None:
            rotate_block(layer, self.rotation)
        self.layers[index] = layer
        self.loads += 1
        self.peak_blocks = max(self.peak_blocks, self.materialized + 1)


def assign_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` at `name` under `root` (a frozen parameter where the template has a parameter, else a
    buffer), replacing whatever (a meta tensor) was there."""
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor


def check_memory(streamed: StreamedModel, activation_tokens: int, max_memory: int | None) -> int:
    """The memory limit (default: 90% of what is available now); exit 2 with what would fit when one block
    of this model, with the embeddings and head, cannot."""
    limit = max_memory if max_memory is not None else int(0.9 * available_memory())
    needed = streamed.needed_bytes(activation_tokens)
    if needed > limit:
        gib = 2**30
        raise QpackError(
            f"this model needs about {needed / gib:.1f} GiB to be processed block by block (one decoder block is "
            f"{streamed.block_bytes(0) / gib:.2f} GiB in FP32, embeddings and head {streamed.resident_bytes() / gib:.2f}"
            f" GiB) but the limit is {limit / gib:.1f} GiB; raise `max_memory` or free memory"
        )
    return limit
