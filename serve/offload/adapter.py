"""The engine's side of the KV offload: where pool blocks meet stored blocks.

`fetch` (the scheduler's callback, engine thread, under the engine lock) loads the next blocks of a prefix chain
that missed the pool into fresh pool blocks, registers them, and hands back their ids; `on_register` (also the
scheduler's) copies each newly registered block out of the pool for write-through. Loading is used only while it
is cheaper than recomputing: the adapter keeps running averages of the seconds one stored block takes to load
and of the seconds one prompt token takes to prefill (reported by the engine), and skips the offload when a block's
tokens would recompute faster than it loads.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from serve.core.block_pool import BlockPool, PrefixKey
from serve.core.request import Request
from serve.core.runner import ModelRunner
from serve.offload.manager import OffloadManager


@dataclass
class Ewma:
    value: float | None = None
    weight: float = 0.2

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample


class OffloadAdapter:
    def __init__(
        self, manager: OffloadManager, pool: BlockPool, runner: ModelRunner, block_size: int
    ) -> None:
        self.manager, self.pool, self.runner, self.block_size = manager, pool, runner, block_size
        self.load_per_block = Ewma()
        self.prefill_per_token = Ewma()
        self.skipped = 0

    def worth_loading(self) -> bool:
        """Loading beats recomputing (true until both have been measured)."""
        load, prefill = self.load_per_block.value, self.prefill_per_token.value
        return load is None or prefill is None or load < prefill * self.block_size

    def fetch(self, request: Request, keys: list[PrefixKey]) -> list[int]:
        if not keys:
            return []
        if not self.worth_loading():
            self.skipped += 1
            return []
        self.manager.touch(request.session, request.owner.session_ttl, request.owner.max_sessions)
        started = time.perf_counter()
        blocks = self.manager.fetch(keys, limit=self.pool.num_free)
        if not blocks:
            return []
        self.load_per_block.add((time.perf_counter() - started) / len(blocks))
        ids = self.pool.allocate(len(blocks)) or []
        for block_id, key, block in zip(ids, keys, blocks, strict=False):
            self.runner.write_block(block_id, block)
            self.pool.register(block_id, key)
        return ids

    def on_register(self, request: Request, block_id: int, key: PrefixKey) -> None:
        block = self.runner.read_block(block_id).cpu()  # a host copy on CUDA
        owner = request.owner
        self.manager.offer(key, block, request.session, owner.session_ttl, owner.max_sessions)

    def forget(
        self,
        tenant: str,
        user: str | None,
        session_id: str | None,
        pool_lock: AbstractContextManager[Any],
        before: float | None = None,
    ) -> int | None:
        """Remove a tenant's session's (or user's) blocks from every store, the pool's prefix cache included; None
        when the tenant has no such session. Only the pool's part runs under `pool_lock` (the engine's)."""
        keys = self.manager.forget(tenant, user, session_id, before)
        if keys is None:
            return None
        with pool_lock:
            self.pool.forget(keys)
        return len(keys)
