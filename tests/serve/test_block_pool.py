"""The block pool with five blocks and no model."""

from __future__ import annotations

import pytest

from serve.core.block_pool import BlockPool, chain_root, prefix_keys


def test_allocate_free_and_exhaustion_returns_none() -> None:
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 2 and pool.usage == pytest.approx(0.6)
    assert pool.allocate(3) is None  # back-pressure, not an exception
    assert pool.num_free == 2  # a failed allocation takes nothing
    b = pool.allocate(2)
    assert b == [3, 4] and pool.allocate(1) is None
    pool.free(a)
    assert pool.num_free == 3 and all(pool.blocks[i].ref_cnt == 0 for i in a)
    assert pool.allocate(3) == [2, 1, 0]  # freed in reverse: the sequence tail goes first
    with pytest.raises(AssertionError):
        pool.free([3, 3])


def test_ref_counts_keep_shared_blocks_alive() -> None:
    pool = BlockPool(5)
    (block,) = pool.allocate(1)
    pool.share([block])
    assert pool.blocks[block].ref_cnt == 2
    pool.free([block])
    assert pool.num_free == 4 and pool.blocks[block].ref_cnt == 1
    pool.free([block])
    assert pool.num_free == 5


def test_prefix_sharing_and_lru_reuse_of_cached_blocks() -> None:
    pool = BlockPool(5)
    system = [7, 7, 7, 7, 8, 8, 8, 8]
    keys = prefix_keys([*system, 1, 2], block_size=4)
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    first = pool.allocate(3)
    for block_id, key in zip(first, keys, strict=False):
        pool.register(block_id, key)
    assert pool.lookup(keys) == first[:2]
    pool.free(first)  # finished: blocks are free but still cached
    assert pool.num_free == 5 and pool.num_cached == 2

    other = prefix_keys([*system, 9, 9, 9, 9], block_size=4)
    hit = pool.lookup(other)
    assert hit == first[:2] and pool.hit_rate > 0
    pool.share(hit)  # a new request revives the cached prefix from the free list
    assert pool.num_free == 3 and all(pool.blocks[b].ref_cnt == 1 for b in hit)
    fresh = pool.allocate(3)  # evicts the least recently freed uncached/other blocks, never the shared ones
    assert fresh is not None and not set(fresh) & set(hit)
    assert pool.allocate(1) is None
    pool.free(hit + fresh)


def test_eviction_forgets_the_prefix() -> None:
    pool = BlockPool(2)
    keys = prefix_keys([1, 2, 3, 4], block_size=4)
    (block,) = pool.allocate(1)
    pool.register(block, keys[0])
    pool.free([block])
    assert pool.lookup(keys) == [block]
    pool.allocate(2)  # the cached block is handed out again: its KV is gone
    assert pool.lookup(keys) == [] and pool.num_cached == 0


def test_different_context_same_tokens_do_not_match() -> None:
    a = prefix_keys([1, 1, 2, 2], block_size=2)
    b = prefix_keys([3, 3, 2, 2], block_size=2)
    assert a[1] != b[1]  # same tokens, different parent: a different block
    pool = BlockPool(5, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.register(block, a[0])
    assert pool.lookup(a) == []


def test_keys_are_sha256_chains_salted_per_tenant() -> None:
    """An independent answer: the chain recomputed with hashlib; salts separate tenants from the first block."""
    import hashlib
    import struct

    tokens = [5, 6, 7, 8, 9, 10, 11]
    keys = prefix_keys(tokens, block_size=3)
    expected, parent = [], hashlib.sha256(b"qpack-prefix-v1\0" + struct.pack("<I", 0)).digest()
    for start in (0, 3):
        parent = hashlib.sha256(parent + struct.pack("<3q", *tokens[start : start + 3])).digest()
        expected.append(parent)
    assert keys == expected
    alice, bob = chain_root(b"alice"), chain_root(b"bob")
    assert prefix_keys(tokens, 3, alice)[0] not in (keys[0], prefix_keys(tokens, 3, bob)[0])
    assert prefix_keys(tokens, 3, alice) == prefix_keys(tokens, 3, chain_root(b"alice"))
    assert prefix_keys(tokens[3:6], 3, keys[0]) == keys[1:]  # extending a chain continues it


def test_a_sequence_extends_its_keys_as_blocks_fill() -> None:
    from serve.core.request import Request, SamplingParams

    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0), cache_salt=b"t1")
    assert request.keys(2) == prefix_keys([1, 2, 3, 4], 2, chain_root(b"t1"))
    request.output_ids += [6, 7, 8]
    assert request.keys(2) == prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, chain_root(b"t1"))
