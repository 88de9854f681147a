"""Session state a tenant cannot grow or stall: the index of stored conversations is bounded (an entry dies with
its last stored block, each tenant has a cap), a deletion or expiry costs only its tenant's sessions, blocks still
queued for a deleted session are never written, and every engine sharing a disk folder keeps its own index, found
again after a restart."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from serve.engine.core import Engine
from serve.offload.codec import BlockLayout
from serve.offload.manager import OffloadManager
from serve.offload.stores import DiskStore, HostStore

LAYOUT = BlockLayout(b"m" * 32, torch.float32, 4, 2, 2, 8)  # 1 KiB raw: one 16 KiB host page per block
OTHER_MODEL = BlockLayout(b"n" * 32, torch.float32, 4, 2, 2, 8)
PAGE = 16 * 1024


def _block(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_an_index_entry_dies_with_its_last_stored_block() -> None:
    tiers = OffloadManager(LAYOUT, HostStore(2 * PAGE), None)  # room for two blocks
    for i in range(3):
        tiers.offer(_key(i), _block(i), ("acme", "u", f"s{i}"))
        tiers.flush()
    assert set(tiers.sessions) == {("acme", "u", "s1"), ("acme", "u", "s2")}  # s0's only block was evicted
    assert tiers.host is not None and tiers.host.delete(_key(1))  # dropped (a corrupt block is deleted so)
    assert set(tiers.sessions) == {("acme", "u", "s2")}
    tiers.close()


def test_a_block_two_sessions_hold_keeps_both_entries_until_it_goes(tmp_path: Path) -> None:
    host, disk = HostStore(4 * PAGE), DiskStore(tmp_path / "t2", 10**6)
    tiers = OffloadManager(LAYOUT, host, disk)
    tiers.offer(_key(1), _block(1), ("acme", "u", "a"))
    tiers.offer(_key(1), _block(1), ("acme", "u", "b"))
    tiers.flush()
    host.delete(_key(1))  # still on disk: both sessions still hold a stored block
    assert set(tiers.sessions) == {("acme", "u", "a"), ("acme", "u", "b")}
    disk.delete(_key(1))
    assert not tiers.sessions
    tiers.close()


def test_each_tenant_indexes_at_most_its_cap_and_the_oldest_session_goes_first() -> None:
    tiers = OffloadManager(LAYOUT, HostStore(64 * PAGE), None)
    for i in range(5):
        tiers.touch(("acme", "u", f"s{i}"), max_sessions=3)
        tiers.offer(_key(i), _block(i), ("acme", "u", f"s{i}"), max_sessions=3)
        tiers.flush()
    tiers.touch(("acme", "u", "s2"), max_sessions=3)  # s2 used again: s3 is now the oldest
    tiers.offer(_key(9), _block(9), ("acme", "u", "s9"), max_sessions=3)
    tiers.offer(_key(10), _block(10), ("globex", "u", "s0"), max_sessions=1)  # another tenant's cap
    tiers.flush()
    assert set(tiers.sessions) == {
        ("acme", "u", "s2"),
        ("acme", "u", "s4"),
        ("acme", "u", "s9"),
        ("globex", "u", "s0"),
    }
    assert tiers.host is not None
    assert [tiers.host.get(_key(i)) is not None for i in (0, 1, 2, 3, 4, 9)] == [0, 0, 1, 0, 1, 1]
    tiers.close()


def test_the_default_cap_applies_to_sessions_that_name_none() -> None:
    tiers = OffloadManager(LAYOUT, HostStore(64 * PAGE), None, max_sessions=2)
    for i in range(4):
        tiers.touch(("acme", "u", f"s{i}"))
    assert set(tiers.sessions) == {("acme", "u", "s2"), ("acme", "u", "s3")}
    tiers.close()


def _crowded(other_sessions: int) -> OffloadManager:
    """Tiers indexing one acme session and `other_sessions` of another tenant (recorded directly: no blocks)."""
    tiers = OffloadManager(LAYOUT, HostStore(8 * PAGE), None, max_sessions=10**7)
    for i in range(other_sessions):
        tiers.touch(("globex", f"user-{i}", "s"))
    tiers.offer(_key(1), _block(1), ("acme", "alice", "s1"))
    tiers.flush()
    return tiers


def test_a_deletion_costs_only_its_tenants_sessions() -> None:
    alone, crowded = _crowded(0), _crowded(200_000)
    timings = []
    for tiers in (alone, crowded):
        started = time.perf_counter()
        assert tiers.forget("acme", "alice", "s1") == [_key(1)]
        timings.append(time.perf_counter() - started)
        tiers.close()
    assert timings[1] < max(0.02, 20 * timings[0]), timings  # a scan of 200,000 sessions takes ~0.1 s


def test_expiry_forgets_idle_sessions_in_one_pass_without_a_whole_index_forget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiers = OffloadManager(LAYOUT, HostStore(64 * PAGE), None, session_ttl=100.0)
    for i in range(6):
        tiers.offer(
            _key(i), _block(i), ("acme" if i % 2 else "globex", "u", f"s{i}"), 10.0 if i < 4 else None
        )
    tiers.flush()

    def whole_scan(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("expire called forget")

    monkeypatch.setattr(tiers, "forget", whole_scan)
    now = time.time()
    assert tiers.expire(now + 5) == 0
    assert tiers.expire(now + 50) == 4  # the 10 s TTL of s0-s3, not the server's 100 s of s4, s5
    assert set(tiers.sessions) == {("globex", "u", "s4"), ("acme", "u", "s5")}
    assert tiers.host is not None and len(tiers.host) == 2
    tiers.close()


class HeldStore(HostStore):
    """A host tier whose writes wait until released: blocks pile up in the write-through queue."""

    def __init__(self) -> None:
        super().__init__(64 * PAGE)
        self.release = threading.Event()

    def put(self, key: bytes, data: bytes) -> bool:
        self.release.wait(30)
        return super().put(key, data)


def test_blocks_queued_for_a_deleted_session_are_never_written() -> None:
    store = HeldStore()
    tiers = OffloadManager(LAYOUT, store, None)
    tiers.offer(_key(0), _block(0), ("acme", "alice", "s1"))
    time.sleep(0.2)  # the writer holds block 0; blocks 1-3 wait in the queue
    for i in (1, 2):
        tiers.offer(_key(i), _block(i), ("acme", "alice", "s1"))
    tiers.offer(_key(3), _block(3), ("acme", "bob", "s1"))
    tiers.forget("acme", "alice", "s1")
    tiers.offer(_key(4), _block(4), ("acme", "alice", "s1"))  # offered after the deletion: a new turn
    store.release.set()
    tiers.flush()
    assert [store.get(_key(i)) is not None for i in range(5)] == [0, 0, 0, 1, 1]
    assert set(tiers.sessions) == {("acme", "bob", "s1"), ("acme", "alice", "s1")}
    assert tiers.sessions[("acme", "alice", "s1")].keys == {_key(4): len(store.get(_key(4)) or b"")}
    tiers.close()


def test_every_engine_sharing_a_disk_folder_finds_its_sessions_after_a_restart(tmp_path: Path) -> None:
    """`qpack serve A B` (two models) and two workers of one model, all on one kv_disk folder."""
    folder = tmp_path / "t2"
    engines = [
        OffloadManager(layout, None, DiskStore(folder, 10**7)) for layout in (LAYOUT, OTHER_MODEL, LAYOUT)
    ]
    for index, tiers in enumerate(engines):
        tiers.offer(_key(index), _block(index), ("acme", "alice", f"engine-{index}"))
        tiers.flush()
    for tiers in engines:
        tiers.close()
    model_a = OffloadManager(LAYOUT, None, DiskStore(folder, 10**7))
    model_b = OffloadManager(OTHER_MODEL, None, DiskStore(folder, 10**7))
    assert set(model_a.sessions) == {("acme", "alice", "engine-0"), ("acme", "alice", "engine-2")}
    assert set(model_b.sessions) == {("acme", "alice", "engine-1")}
    assert model_a.forget("acme", "alice", None) == [_key(0), _key(2)]
    model_a.close()
    again = OffloadManager(LAYOUT, None, DiskStore(folder, 10**7))
    assert not again.sessions
    again.close()
    model_b.close()


def _index_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (folder / "sessions").rglob("t-*")}


def test_a_deletion_appends_a_line_to_its_tenants_log_and_rewrites_no_index(tmp_path: Path) -> None:
    tiers = OffloadManager(LAYOUT, None, DiskStore(tmp_path / "t2", 10**7))
    tiers.offer(_key(1), _block(1), ("acme", "alice", "s1"))
    tiers.offer(_key(2), _block(2), ("globex", "bob", "s1"))
    tiers.flush()
    files = _index_files(tmp_path / "t2")
    assert sorted(files) == ["t-acme.log", "t-globex.log"], files  # one log per tenant
    assert tiers.forget("acme", "alice", "s1") == [_key(1)]
    tiers.flush()
    after = _index_files(tmp_path / "t2")
    assert sorted(after) == sorted(files) and after["t-globex.log"] == files["t-globex.log"]
    assert 0 < after["t-acme.log"] - files["t-acme.log"] < 100  # one line
    tiers.close()
    again = OffloadManager(LAYOUT, None, DiskStore(tmp_path / "t2", 10**7))
    assert set(again.sessions) == {("globex", "bob", "s1")}
    again.flush()  # taken over: written whole once, the logs emptied
    assert sorted(_index_files(tmp_path / "t2")) == ["t-globex.json"]
    again.close()


def test_a_long_log_is_folded_into_its_tenants_file(tmp_path: Path) -> None:
    tiers = OffloadManager(LAYOUT, None, DiskStore(tmp_path / "t2", 10**8))
    for _ in range(1200):
        tiers.touch(("acme", "u", "s"))
        tiers.forget("acme", "u", "s")
    tiers.offer(_key(1), _block(1), ("acme", "u", "kept"))
    tiers.flush()
    assert sorted(_index_files(tmp_path / "t2")) in (["t-acme.json"], ["t-acme.json", "t-acme.log"])
    tiers.close()
    again = OffloadManager(LAYOUT, None, DiskStore(tmp_path / "t2", 10**8))
    assert set(again.sessions) == {("acme", "u", "kept")}
    again.close()


def test_a_legacy_index_is_taken_over_by_one_engine(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "t2"
    disk = DiskStore(folder, 10**7)
    disk.put(_key(1), b"x" * 10)
    legacy = {
        "format": 2,
        "sessions": [
            {"tenant": "acme", "user": "a", "session": "s", "last_use": time.time(), "ttl": None, "keys": {}},
            {
                "tenant": "acme",
                "user": "b",
                "session": "s",
                "last_use": time.time(),
                "ttl": None,
                "keys": {_key(1).hex(): 10, _key(2).hex(): 10},  # block 2 is not stored any more
            },
        ],
    }
    (folder / "sessions.json").write_text(json.dumps(legacy))
    tiers = OffloadManager(LAYOUT, None, disk)
    assert set(tiers.sessions) == {("acme", "b", "s")}  # a session without a stored block is no entry
    assert tiers.sessions[("acme", "b", "s")].keys == {_key(1): 10}
    assert not (folder / "sessions.json").exists()
    tiers.close()


LIMITED = """\
[tenants.acme]
keys = ["key-tenant-a"]
requests_per_minute = 3

[tenants.globex]
keys = ["key-tenant-b"]
max_sessions = 2
"""
ACME, GLOBEX = ({"Authorization": f"Bearer key-tenant-{x}"} for x in "ab")
STORY = "Once upon a time there was a little girl who liked to play in the park with her dog every day"


@pytest.fixture()
def limited_server(tiny_llama: Path, tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    from serve.http import BackgroundServer
    from serve.openai import ServerInfo
    from serve.tenancy.tenants import TenantsSource
    from tests.serve.test_api import make_engine

    path = tmp_path / "tenants.toml"
    path.write_text(LIMITED)
    engine = make_engine(
        tiny_llama, kv_host_memory=8 * 2**20, kv_disk=str(tmp_path / "t2"), max_model_len=512
    )
    info = ServerInfo(name="tiny", version="1", tenants=TenantsSource(path), request_timeout=60)
    with BackgroundServer(engine, info) as url:
        yield url, engine


def test_deletions_pass_the_tenants_request_limit(limited_server: tuple[str, Engine]) -> None:
    url, _engine = limited_server
    answers = [
        httpx.delete(f"{url}/v1/sessions/s{i}", params={"user": "alice"}, headers=ACME, timeout=30)
        for i in range(5)
    ]
    assert [a.status_code for a in answers] == [404, 404, 404, 429, 429]
    assert answers[3].json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in answers[3].headers
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    other = httpx.delete(f"{url}/v1/sessions/s1", params={"user": "alice"}, headers=GLOBEX, timeout=30)
    assert other.status_code == 404  # another tenant's limit is its own


def test_a_deletion_neither_holds_the_event_loop_nor_waits_on_a_step_to_drop_stored_blocks(
    limited_server: tuple[str, Engine],
) -> None:
    url, engine = limited_server
    body = {"prompt": STORY, "max_tokens": 2, "temperature": 0, "user": "bob", "session_id": "s1"}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=GLOBEX, timeout=60).status_code == 200
    assert engine.offload is not None
    tiers = engine.offload.manager
    tiers.flush()
    stored = set(tiers.sessions[("globex", "bob", "s1")].keys)
    assert stored and tiers.host is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool, engine.lock:  # a step that takes long
        deleting = pool.submit(
            httpx.delete, f"{url}/v1/sessions/s1", params={"user": "bob"}, headers=GLOBEX, timeout=30
        )
        deadline = time.monotonic() + 10
        while any(key in tiers.host for key in stored):
            assert time.monotonic() < deadline, "the stored blocks were not deleted while a step ran"
            time.sleep(0.02)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # the event loop is free
        assert not deleting.done()  # only the prefix cache waits for the step
    deleted = deleting.result()
    assert deleted.status_code == 200 and deleted.json()["blocks"] == len(stored)
    assert ("globex", "bob", "s1") not in tiers.sessions


def test_a_deletion_sent_while_a_worker_is_down_is_applied_when_it_starts(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.serve.test_fleet as fleet
    from serve.fleet.local_redis import LocalRedis
    from tests.serve.test_api import make_engine

    disk = tmp_path / "t2"
    monkeypatch.setattr(
        fleet,
        "make_engine",
        lambda model_dir, **kw: make_engine(
            model_dir,
            kv_host_memory=8 * 2**20,
            kv_disk=str(disk),
            kv_disk_size=8 * 2**20,
            max_model_len=512,
            **kw,
        ),
    )
    body = {"prompt": STORY, "max_tokens": 2, "temperature": 0, "user": "alice", "session_id": "s1"}
    with LocalRedis(tmp_path / "redis") as redis_server, fleet.gateway(redis_server.url) as base:
        with fleet.worker(tiny_llama, redis_server.url) as first:
            fleet.wait_for(lambda: fleet.live_workers(base) == 1, what="the worker's heartbeat")
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
            assert first.engine.offload is not None
            first.engine.offload.manager.flush()
            stored = set(first.engine.offload.manager.sessions[("default", "alice", "s1")].keys)
        first.engine.close()
        fleet.wait_for(lambda: fleet.live_workers(base) == 0, what="the worker's heartbeat to lapse")
        deleted = httpx.delete(f"{base}/v1/sessions/s1", params={"user": "alice"}, timeout=30)
        assert deleted.status_code == 202 and deleted.json()["workers"] == 0, deleted.text
        assert all((disk / k.hex()[:2] / f"{k.hex()}.kv").exists() for k in stored)  # nobody applied it yet
        with fleet.worker(tiny_llama, redis_server.url) as second:
            assert second.engine.offload is not None
            tiers = second.engine.offload.manager
            fleet.wait_for(lambda: not any(key in tiers.disk for key in stored), what="the kept deletion")  # type: ignore[operator]
            assert ("default", "alice", "s1") not in tiers.sessions
            fleet.wait_for(lambda: fleet.live_workers(base) == 1, what="the worker's heartbeat")
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
            tiers.flush()
            time.sleep(1.5)  # the worker follows the kept deletions: the session begun again stays
            assert ("default", "alice", "s1") in tiers.sessions
        second.engine.close()


def test_the_gateway_passes_deletions_through_the_tenants_request_limit(tmp_path: Path) -> None:
    import tests.serve.test_fleet as fleet
    from serve.fleet.local_redis import LocalRedis
    from serve.openai import ServerInfo
    from serve.tenancy.tenants import TenantsSource

    path = tmp_path / "tenants.toml"
    path.write_text(LIMITED)
    info = ServerInfo("fleet", "", tenants=TenantsSource(path))
    with LocalRedis(tmp_path / "redis") as redis_server, fleet.gateway(redis_server.url, info=info) as base:
        answers = [
            httpx.delete(f"{base}/v1/sessions/s{i}", params={"user": "alice"}, headers=ACME, timeout=30)
            for i in range(4)
        ]
        assert [a.status_code for a in answers] == [202, 202, 202, 429]  # no worker live: kept for them
        assert answers[3].json()["error"]["code"] == "rate_limit_exceeded"
        other = httpx.delete(f"{base}/v1/sessions/s1", params={"user": "alice"}, headers=GLOBEX, timeout=30)
        assert other.status_code == 202


def test_the_tenants_file_caps_its_sessions_on_a_server(limited_server: tuple[str, Engine]) -> None:
    url, engine = limited_server
    assert engine.offload is not None
    for i in range(3):
        body = {
            "prompt": f"Chapter {i}. {STORY}",
            "max_tokens": 2,
            "temperature": 0,
            "user": "bob",
            "session_id": f"s{i}",
        }
        assert httpx.post(f"{url}/v1/completions", json=body, headers=GLOBEX, timeout=60).status_code == 200
        engine.offload.manager.flush()
    assert set(engine.offload.manager.sessions) == {("globex", "bob", "s1"), ("globex", "bob", "s2")}
