"""A request's KV blocks: what it holds of the pool, grown, shared from the prefix cache, registered, released.

The scheduler decides who runs; this decides which blocks each request holds (vLLM's `v1/core/kv_cache_manager.py`
plays the same part). Tensor-free like the pool under it: the invariants are block counts, tested with a handful of
blocks. A request's blocks cover its computed tokens; its first `num_registered` blocks are full and registered
under their chain keys (so other requests may share them); only its last block may be partly empty. Where a prefix
misses the pool's cache, `fetch` may supply the chain's next blocks from the KV offload (already filled and
registered), and `on_register` hears of every block registered here, so the offload can write it through.
"""

from __future__ import annotations

from collections.abc import Callable

from serve.core.block_pool import BlockPool, PrefixKey
from serve.core.request import Request, Status

# fetch(request, keys) -> block ids holding the KV of the leading keys (fresh, ref 1, registered); may be shorter
Fetch = Callable[[Request, list[PrefixKey]], list[int]]
OnRegister = Callable[[Request, int, PrefixKey], None]


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        fetch: Fetch | None = None,
        on_register: OnRegister | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.fetch = fetch
        self.on_register = on_register

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions."""
        return -(-tokens // self.block_size)

    def can_hold(self, tokens: int) -> bool:
        """Whether the free blocks hold `tokens` new positions."""
        return self.pool.num_free >= self.blocks_for(tokens)

    def grow(self, request: Request, tokens: int) -> bool:
        """Blocks for the request's first `tokens` positions; False, taking nothing, when the pool is short."""
        need = self.blocks_for(tokens) - len(request.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        return True

    def release(self, request: Request) -> None:
        """Give back every block the request holds; its progress starts over."""
        if request.block_ids:
            self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed = 0
        request.num_registered = 0

    def take_cached_prefix(self, request: Request) -> None:
        """Seat a request on the longest prefix the pool's cache (then `fetch`) holds of its tokens, leaving at
        least its last token to compute."""
        cacheable = (request.num_tokens - 1) // self.block_size
        keys = request.keys(self.block_size)[:cacheable]
        hits = self.pool.lookup(keys)
        self.pool.share(hits)
        loaded = (
            self.fetch(request, keys[len(hits) :]) if self.fetch is not None and len(hits) < len(keys) else []
        )
        request.block_ids = [*hits, *loaded]
        request.num_computed = len(request.block_ids) * self.block_size
        request.num_registered = len(request.block_ids)

    def register_full(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens fill (and tell `on_register`)."""
        full = request.num_computed // self.block_size
        if full > request.num_registered:
            keys = request.keys(self.block_size)
            for index in range(request.num_registered, full):
                self.pool.register(request.block_ids[index], keys[index])
                if self.on_register is not None:
                    self.on_register(request, request.block_ids[index], keys[index])
            request.num_registered = full

    def reserve(self, request: Request, tokens: int) -> bool:
        """Blocks for the first `tokens` positions of a running request (speculative rows beyond its tokens);
        False, taking nothing, when the pool is short: speculation never preempts."""
        return request.status is Status.RUNNING and self.grow(request, tokens)

    def settle(self, request: Request, num_computed: int, trim: bool = True) -> None:
        """After a verifying step: the KV of the first `num_computed` tokens is the request's. Full blocks are
        registered (as a plain decode registers them before sampling its next token) and, with `trim`, blocks held
        past them (rejected proposals) are freed, leaving the pool as if only the accepted tokens had been
        computed. Nothing is registered (so nothing written through to the offload) beyond them."""
        if request.finished:
            return
        assert num_computed <= request.num_tokens, "only tokens the request has can be settled"
        if trim:
            keep = self.blocks_for(num_computed)
            surplus = request.block_ids[keep:]
            if surplus:
                self.pool.free(surplus)
                del request.block_ids[keep:]
        request.num_computed = num_computed
        self.register_full(request)

    def waste(self, running: list[Request]) -> tuple[int, int]:
        """(slots held by running requests, of which unused): only a request's last block can be partly empty,
        since shared prefix blocks are full by construction."""
        size = self.block_size
        held = {b for s in running for b in s.block_ids}
        unused = sum(len(s.block_ids) * size - min(s.num_tokens, len(s.block_ids) * size) for s in running)
        return len(held) * size, unused
