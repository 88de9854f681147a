"""The KV block pool: which fixed-size KV slots belong to whom, with prefix sharing and LRU reuse.

Pure Python and tensor-free on purpose (like vLLM's `v1/core/block_pool.py`): the scheduler's decisions are
all about block bookkeeping, so they are tested here with a handful of blocks and no model.

- Blocks live in a free list ordered least-recently-freed first; allocation pops from the head.
- Every block has a `ref_cnt`: sequences sharing a prefix share its blocks; a block returns to the free list
  only when its last user frees it.
- A *full* block can be registered under its chain key: sha256 over the parent block's key and the block's
  token ids, the first block's parent being a root digest of an optional salt. A later request whose prompt
  starts with the same tokens (and salt) finds those blocks and reuses their KV instead of recomputing it
  (system prompts, few-shot examples). The key is a cryptographic digest of the whole prefix, not a 64-bit
  `hash()` of it: a client cannot craft a different prefix that collides with another's and read KV it did not
  compute (the class of vLLM's CVE-2025-25183), and tenants with different salts never share or probe each
  other's blocks. Freed blocks keep their contents and key while they sit in the free list, so a prefix stays
  reusable until its block is actually handed out again (LRU eviction).
- Running out is normal back-pressure, not an error: `allocate` returns `None` and the scheduler decides
  (wait, or preempt a sequence).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

PrefixKey = bytes  # sha256 digest of the chain up to and including a block

_DOMAIN = b"qpack-prefix-v1\0"


def chain_root(salt: bytes = b"") -> PrefixKey:
    """The parent of every first block: a digest of the salt (empty: the shared, unsalted chain)."""
    return hashlib.sha256(_DOMAIN + struct.pack("<I", len(salt)) + salt).digest()


ROOT = chain_root()
_REJOIN = b"qpack-prefix-rejoin-v1\0"


def rejoin(parent: PrefixKey, salt: bytes) -> PrefixKey:
    """The parent of the first block after a prefix shared across tenants: the shared chain's last key mixed
    with the tenant's own salt, so that everything after the shared text is the tenant's alone again."""
    return hashlib.sha256(_REJOIN + parent + struct.pack("<I", len(salt)) + salt).digest()


def prefix_keys(tokens: Sequence[int], block_size: int, parent: PrefixKey = ROOT) -> list[PrefixKey]:
    """Chained keys of the full blocks of `tokens`: key_i = sha256(key_{i-1} || block i's ids as int64 LE),
    key_-1 = `parent` (`chain_root(salt)`, or the key of the block before `tokens` when extending a chain)."""
    keys: list[PrefixKey] = []
    pack = struct.Struct(f"<{block_size}q").pack
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + pack(*tokens[start : start + block_size])).digest()
        keys.append(parent)
    return keys


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    key: PrefixKey | None = None


@dataclass
class BlockPool:
    num_blocks: int
    enable_caching: bool = True
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[PrefixKey, int] = field(init=False)
    cache_queries: int = 0
    cache_hits: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (ref_cnt 1), least recently freed first; None if there are not enough."""
        if count > len(self._free):
            return None
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self._cached.get(block.key) == block_id:
                    del self._cached[block.key]
                block.key = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the tail of the free list.

        Freed in reverse so that a sequence's *last* blocks are evicted first and its prefix survives longest.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} freed more often than allocated"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def lookup(self, keys: Sequence[PrefixKey]) -> list[int]:
        """Longest run of cached blocks matching `keys` from the start (does not take references)."""
        if not self.enable_caching:
            return []
        found = []
        for key in keys:
            self.cache_queries += 1
            block_id = self._cached.get(key)
            if block_id is None:
                break
            self.cache_hits += 1
            found.append(block_id)
        return found

    def share(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cached blocks (a prefix-cache hit); revives them from the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def register(self, block_id: int, key: PrefixKey) -> None:
        """Mark a full block as holding the KV for `key` so later prompts can share it."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.key is not None:
            return
        if key in self._cached:
            return  # an identical block is already cached; this one stays private
        block.key = key
        self._cached[key] = block_id

    def forget(self, keys: Sequence[PrefixKey]) -> int:
        """Unregister these keys (a deleted session): their blocks stay with whoever holds them, but no later
        prompt can reuse them. Returns how many were cached."""
        count = 0
        for key in keys:
            block_id = self._cached.pop(key, None)
            if block_id is not None:
                self.blocks[block_id].key = None
                count += 1
        return count

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0
