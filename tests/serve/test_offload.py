"""KV offload below the pool: codec integrity, stores, write-through that never blocks, and the engine serving
returning conversations from host memory and, after a restart, from disk, with outputs identical to
recomputing them."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from quantize.model.sources import load_model, load_tokenizer, resolve_model
from serve.core.block_pool import chain_root, prefix_keys
from serve.core.request import Owner, SamplingParams
from serve.engine.builder import write_queue_bytes
from serve.engine.core import Engine
from serve.offload.codec import BlockLayout, CorruptBlock, _shuffle, _unshuffle, decode, encode, intact
from serve.offload.manager import OffloadManager
from serve.offload.stores import DiskStore, HostStore
from tests.serve.engines import config_from_options

LAYOUT = BlockLayout(b"m" * 32, torch.float32, 4, 2, 2, 8)


def _block(seed: int, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype)


@pytest.mark.parametrize("codec", ["zstd", "zlib", "lz4", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_round_trips_bit_exact(codec: str, dtype: torch.dtype) -> None:
    layout = BlockLayout(b"m" * 32, dtype, 4, 2, 2, 8)
    block = _block(1, layout)
    back = decode(layout, b"k" * 32, encode(layout, b"k" * 32, block, codec))
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), block.view(torch.uint8))


def test_the_byte_shuffle_layout_is_fixed() -> None:
    """Stored files depend on this byte order: all first bytes of the elements, then all second bytes, ..."""
    assert _shuffle(torch.arange(8, dtype=torch.uint8), 4) == bytes([0, 4, 1, 5, 2, 6, 3, 7])
    assert _unshuffle(bytes([0, 4, 1, 5, 2, 6, 3, 7]), 4).tolist() == list(range(8))


def test_damaged_truncated_and_foreign_blocks_are_refused() -> None:
    key = b"k" * 32
    data = encode(LAYOUT, key, _block(2))
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    cases = {
        "checksum mismatch": bytes(flipped),
        "truncated": data[:-10],
        "header": data[:20],
        "another model": encode(BlockLayout(b"x" * 32, torch.float32, 4, 2, 2, 8), key, _block(2)),
        "dtype": encode(BlockLayout(b"m" * 32, torch.bfloat16, 4, 2, 2, 8), key, _block(2).bfloat16()),
        "another key": encode(LAYOUT, b"o" * 32, _block(2)),
    }
    for name, bad in cases.items():
        with pytest.raises(CorruptBlock):
            decode(LAYOUT, key, bad)
        assert name
    damaged = ("checksum mismatch", "truncated", "header")
    assert intact(data) and not any(intact(cases[name]) for name in damaged)


def test_chain_keys_differ_by_model_dtype_block_size_and_salt() -> None:
    tokens = list(range(16))
    roots = {
        chain_root(b"model-a|float32|4"),
        chain_root(b"model-b|float32|4"),
        chain_root(b"model-a|bfloat16|4"),
        chain_root(b"model-a|float32|4|salt"),
    }
    firsts = {prefix_keys(tokens, 4, root)[0] for root in roots}
    assert len(roots) == len(firsts) == 4


def test_stores_evict_least_recently_used_by_size(tmp_path: Path) -> None:
    host = HostStore(capacity=250, page_size=50)  # 5 pages; a 100-byte block takes 2
    for key in (b"a", b"b", b"c"):
        host.put(key, b"x" * 100)
    assert host.get(b"a") is None and host.size == 200  # a evicted to fit c
    host.get(b"b")  # b is now the most recent
    host.put(b"d", b"y" * 100)
    assert host.get(b"c") is None and host.get(b"b") is not None
    disk = DiskStore(tmp_path / "t2", capacity=250)
    for key in (b"a" * 32, b"b" * 32, b"c" * 32):
        disk.put(key, b"z" * 100)
        time.sleep(0.01)
    assert disk.get(b"a" * 32) is None and disk.get(b"c" * 32) == b"z" * 100
    restarted = DiskStore(tmp_path / "t2", capacity=250)  # the index is rebuilt from the files
    assert len(restarted) == 2 and restarted.get(b"b" * 32) == b"z" * 100
    assert not list((tmp_path / "t2").glob("??/*.tmp"))


def test_host_blocks_of_any_size_round_trip_through_pages_and_reuse_freed_ones() -> None:
    host = HostStore(capacity=1000, page_size=64)  # 15 pages
    blocks = {bytes([i]): bytes(range(i, i + 1)) * (37 * i + 1) for i in range(1, 12)}
    for key, data in blocks.items():
        assert host.put(key, data)
    kept = [key for key in blocks if host.get(key) is not None]
    assert kept and kept == list(blocks)[-len(kept) :]  # the newest survive, least recently used went first
    for key in kept:
        assert host.get(key) == blocks[key]
    assert host.size <= 15 * 64 and not host.put(b"huge", b"x" * 1001)
    host.delete(kept[-1])
    assert host.get(kept[-1]) is None and host.put(b"again", blocks[kept[-1]])
    assert host.get(b"again") == blocks[kept[-1]]
    assert host.put(b"empty", b"") and host.get(b"empty") == b""


def test_a_read_only_disk_disables_the_disk_store_with_one_warning(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    disk = DiskStore(tmp_path / "t2", capacity=10_000)

    def refuse(*_args, **_kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("serve.offload.stores.tempfile.mkstemp", refuse)
    assert not disk.put(b"a" * 32, b"x") and not disk.put(b"b" * 32, b"y")
    assert not disk.enabled and "Read-only" in (disk.disabled_reason or "")
    assert sum("disk store disabled" in r.message for r in caplog.records) == 1


class SlowStore(HostStore):
    """A store whose writes take forever (a stuck disk): the engine must never wait for it."""

    def __init__(self) -> None:
        super().__init__(10**9)
        self.release = threading.Event()

    def put(self, key: bytes, data: bytes) -> bool:
        self.release.wait(30)
        return super().put(key, data)


def test_a_full_write_queue_drops_and_counts_instead_of_blocking() -> None:
    slow = SlowStore()
    tiers = OffloadManager(LAYOUT, slow, None, queue_size=2)
    results = [tiers.offer(bytes([i]) * 32, _block(i), None) for i in range(10)]
    assert results.count(False) >= 7 and tiers.stats.dropped == results.count(False)  # returned at once
    slow.release.set()
    tiers.close()


def test_the_write_queue_is_bounded_in_bytes() -> None:
    block = LAYOUT.raw_bytes
    sized = [OffloadManager(LAYOUT, HostStore(10**6), None, queue_bytes=n * block) for n in (0, 3, 10**6)]
    assert [t.queue_capacity for t in sized] == [2, 3, 256]
    for tiers in sized:
        tiers.close()
    assert write_queue_bytes(0) == 16 * 2**20 and write_queue_bytes(2 * 10**9) == 10**8


def _engine(model_dir: Path, tmp: Path | None, model_hash: str = "v1", **options) -> Engine:
    source = resolve_model(str(model_dir))
    config = config_from_options(
        block_size=4,
        kv_memory=options.pop("kv_memory", 20 * 4 * 2 * 2 * 2 * 16 * 4),  # 20 blocks of the tiny llama
        max_model_len=80,
        kv_host_memory=options.pop("kv_host_memory", 8 * 2**20),
        kv_disk=str(tmp) if tmp is not None else None,
        kv_disk_size=8 * 2**20,
        model_hash=model_hash,
        **options,
    )
    return Engine(load_model(source), load_tokenizer(source), config)


def _generate(
    engine: Engine, prompt: list[int], request: str, session: str | None = None
) -> tuple[list[int], int]:
    out: queue.Queue = queue.Queue()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    owner = Owner(user="alice", session_id=session) if session else Owner()
    engine.add(request, prompt, params, out.put, owner=owner)
    while engine.has_work():
        engine.step()
    ids, cached = [], 0
    while not out.empty():
        output = out.get()
        ids += output.token_ids
        cached = output.cached_tokens
    return ids, cached


HISTORY = [1, *range(40, 76)]  # 37 tokens: 9 full blocks


def test_a_returning_conversation_loads_from_host_memory_and_matches_recompute(tiny_llama: Path) -> None:
    plain = _engine(tiny_llama, None, kv_host_memory=0)
    expected, _ = _generate(plain, HISTORY, "plain")
    engine = _engine(tiny_llama, None)
    first, cached = _generate(engine, HISTORY, "turn-1", "s1")
    assert first == expected and cached == 0
    engine.offload.manager.flush()
    for index in range(3):  # other conversations push turn 1's blocks out of the pool
        _generate(engine, [2, *range(100 + 20 * index, 136 + 20 * index)], f"other-{index}")
    assert not engine.pool.lookup(prefix_keys(HISTORY, 4, chain_root(engine.prefix_salt(Owner()))))  # evicted
    again, cached = _generate(engine, HISTORY, "turn-2", "s1")
    assert again == expected  # token-identical to recomputing
    assert cached >= 32 and engine.offload.manager.stats.hits["host"] >= 8
    engine.close()


def test_after_a_restart_the_disk_tier_serves_and_a_new_version_never_does(
    tiny_llama: Path, tmp_path: Path
) -> None:
    first = _engine(tiny_llama, tmp_path / "t2", kv_host_memory=0)
    expected, _ = _generate(first, HISTORY, "a", "s1")
    first.close()
    restarted = _engine(tiny_llama, tmp_path / "t2", kv_host_memory=0)
    again, cached = _generate(restarted, HISTORY, "b", "s1")
    assert again == expected and cached >= 32 and restarted.offload.manager.stats.hits["disk"] >= 8
    restarted.close()
    newer = _engine(tiny_llama, tmp_path / "t2", model_hash="v2", kv_host_memory=0)
    _ids, cached = _generate(newer, HISTORY, "c")
    assert cached == 0 and newer.offload.manager.stats.hits["disk"] == 0
    newer.close()


def test_corrupted_disk_blocks_are_counted_and_recomputed(tiny_llama: Path, tmp_path: Path) -> None:
    first = _engine(tiny_llama, tmp_path / "t2", kv_host_memory=0)
    expected, _ = _generate(first, HISTORY, "a")
    first.close()
    files = sorted((tmp_path / "t2").glob("??/*.kv"))
    for path in files[::2]:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = _engine(tiny_llama, tmp_path / "t2", kv_host_memory=0)
    again, _cached = _generate(restarted, HISTORY, "b")
    assert again == expected and restarted.offload.manager.stats.corrupt["disk"] >= 1
    assert 'qpack_kv_offload_corrupt_blocks_total{store="disk"}' in restarted.metrics.render().decode()
    restarted.close()


def test_deleting_a_session_removes_its_blocks_from_every_tier(tiny_llama: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_llama, tmp_path / "t2")
    _generate(engine, HISTORY, "a", "s1")
    engine.offload.manager.flush()
    stored = len(engine.offload.manager.host or [])
    assert stored >= 8 and len(list((tmp_path / "t2").glob("??/*.kv"))) >= 8
    assert engine.forget_sessions("other-tenant", "alice", "s1") is None  # not its session
    removed = engine.forget_sessions("default", "alice", "s1")
    assert removed == stored and len(engine.offload.manager.host or []) == 0
    assert not list((tmp_path / "t2").glob("??/*.kv"))
    _ids, cached = _generate(engine, HISTORY, "b")
    assert cached == 0  # not even the pool's prefix cache still serves it
    engine.close()


def test_the_api_records_sessions_and_deletes_them(tiny_llama: Path, tmp_path: Path) -> None:
    import httpx

    from serve.http import BackgroundServer
    from serve.openai import ServerInfo

    engine = _engine(tiny_llama, tmp_path / "t2", kv_memory="1MB")
    prompt = "Once upon a time there was a little girl who liked to play in the park with her dog every day"
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "user": "alice", "session_id": "chat-7"}
    with BackgroundServer(engine, ServerInfo(name="tiny", version="1")) as url:
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        engine.offload.manager.flush()
        assert ("default", "alice", "chat-7") in engine.offload.manager.sessions
        bad = httpx.post(f"{url}/v1/completions", json={**body, "session_id": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
        deleted = httpx.delete(f"{url}/v1/sessions/chat-7", params={"user": "alice"}).json()
        assert deleted["blocks"] > 0 and ("default", "alice", "chat-7") not in engine.offload.manager.sessions
        assert httpx.delete(f"{url}/v1/sessions").status_code == 400
        gone = httpx.delete(f"{url}/v1/sessions", params={"user": "alice"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert not list((tmp_path / "t2").glob("??/*.kv"))


def test_sessions_are_per_tenant_and_expire_by_their_tenants_ttl(tmp_path: Path) -> None:
    """Two tenants may both have a user `alice` with a session `s1`: they are two sessions, deleted and expired
    apart, each by its own tenant's TTL (else the server's), and the index on disk keeps them apart too."""
    tiers = OffloadManager(LAYOUT, HostStore(10**6), DiskStore(tmp_path / "t2", 10**6), session_ttl=100.0)
    tiers.offer(b"a" * 32, _block(1), ("acme", "alice", "s1"), 10.0)
    tiers.offer(b"b" * 32, _block(2), ("globex", "alice", "s1"), None)
    tiers.flush()
    assert tiers.forget("initech", "alice", "s1") is None  # no such session in that tenant
    now = time.time()
    assert tiers.expire(now + 5) == 0
    assert tiers.expire(now + 50) == 1  # acme's 10 s TTL, not the server's 100 s
    assert set(tiers.sessions) == {("globex", "alice", "s1")} and tiers.host.get(b"a" * 32) is None  # type: ignore[union-attr]
    tiers.close()
    reopened = OffloadManager(LAYOUT, None, DiskStore(tmp_path / "t2", 10**6))
    assert set(reopened.sessions) == {("globex", "alice", "s1")}
    assert reopened.forget("globex", "alice", None) == [b"b" * 32]
    reopened.close()
