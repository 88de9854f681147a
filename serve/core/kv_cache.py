"""The paged KV pool's geometry: bytes per token, blocks that fit a memory budget, the pool tensors.

One place for the arithmetic that the engine (blocks from `--kv-memory`), the runner (allocating the pool) and
the decode benchmark (memory for a workload) all need, so they cannot disagree on what a block costs. Each layer
has a K and a V pool of [slots, kv_heads, head_dim], slot = block id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.kv_formats import KV_DTYPE_NAMES

KV_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in KV_DTYPE_NAMES}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, config: object, dtype: torch.dtype = torch.float32) -> KVLayout:
        """The layout of a Hugging Face config's KV cache (GQA and explicit head_dim respected)."""
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)  # type: ignore[attr-defined]
        return cls(int(config.num_hidden_layers), heads, kv_heads, head_dim, dtype)  # type: ignore[attr-defined]

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def blocks_within(self, memory_bytes: int, block_size: int) -> int:
        """Whole blocks of `block_size` tokens that fit `memory_bytes`."""
        return memory_bytes // (self.bytes_per_token * block_size)

    def memory_for(self, num_blocks: int, block_size: int) -> int:
        """Bytes of a pool of `num_blocks` blocks."""
        return num_blocks * block_size * self.bytes_per_token

    def allocate(
        self, num_blocks: int, block_size: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed K and V pools, one [slots, kv_heads, head_dim] tensor per layer each."""
        slots = num_blocks * block_size

        def pool() -> list[torch.Tensor]:
            return [
                torch.zeros(slots, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=device)
                for _ in range(self.num_layers)
            ]

        return pool(), pool()


def parse_memory(value: str | float | int, device: torch.device) -> int:
    """Bytes from '512MB', '2GiB', 1e9, or a fraction of currently free memory ('0.25')."""
    from quantize.common.memory import available_memory
    from quantize.common.sizes import parse_size

    free = None
    if (isinstance(value, int | float) and 0 < float(value) <= 1) or (
        isinstance(value, str) and _is_fraction(value)
    ):
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    return parse_size(value, "--kv-memory", free)


def _is_fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False
