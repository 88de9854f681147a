"""The surge controller at a fleet gateway, on a real `redis-server`, with two workers serving two variants of one
tiny model: `/v1/models` lists the variants, answers name theirs, a request may pin one; under a burst the gateway
moves the free tier to the cheaper variant and sheds it while the priority tier stays on the accurate one, and the
knobs it sets reach the workers' engines through Redis (parity with the single server's test)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from serve.control.controller import ControlConfig
from serve.core.config import SchedulerConfig
from serve.engine.config import CacheConfig, EngineConfig
from serve.engine.protocol import Knobs
from serve.fleet import wire as P
from serve.fleet.local_redis import LocalRedis
from serve.fleet.run import host_workers
from serve.fleet.worker import FleetWorker, WorkerConfig
from serve.loading import build_engine, load_for_serving
from serve.openai import ServerInfo
from serve.options import ServeOptions
from serve.tenancy.tenants import TenantsSource
from tests.serve.test_fleet import gateway, live_workers, local_redis, wait_for
from tests.serve.test_surge_api import TENANTS, A, B, artifacts

__all__ = ["artifacts", "local_redis"]  # fixtures, used by name


def build_worker(path: Path, url: str) -> FleetWorker:
    loaded = load_for_serving(str(path))
    engine = build_engine(
        loaded,
        EngineConfig(
            cache=CacheConfig(block_size=4, memory="16MB"),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
            max_model_len=256,
        ),
    )
    config = WorkerConfig(url, "tiny", loaded.version, loaded.content_hash, variant=loaded.name, kl=loaded.kl)
    return FleetWorker(engine, config)


def one_process_both_variants(artifacts: dict[str, Path], url: str) -> list[FleetWorker]:
    """What `qpack serve int8 int4 --role all` starts in each worker process (`--worker-variants all`)."""
    options = ServeOptions(
        str(artifacts["tiny-int8"]),
        variants=(str(artifacts["tiny-int4"]),),
        model_name="tiny",
        kv_memory="16MB",
        block_size=4,
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        redis=url,
        role="worker",
    )
    return host_workers(options, url, lambda _message: None)


@contextmanager
def running(workers: list[FleetWorker]) -> Iterator[list[FleetWorker]]:
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    try:
        yield workers
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)


@pytest.mark.parametrize("layout", ["a variant each", "both variants in one process"])
def test_the_gateway_routes_variants_by_tier_and_load_and_its_knobs_reach_the_workers(
    artifacts: dict[str, Path], local_redis: LocalRedis, tmp_path: Path, layout: str
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    control = ControlConfig(
        tick=0.1, horizon=0.5, latency=Knobs(1, 64, 32), throughput=Knobs(2, 64, 32), dwell=1.0, capacity=5.0
    )
    info = ServerInfo("fleet", "", TenantsSource(path), request_timeout=120, control=control)
    body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    if layout == "a variant each":
        workers = [build_worker(artifacts[name], local_redis.url) for name in ("tiny-int8", "tiny-int4")]
    else:
        workers = one_process_both_variants(artifacts, local_redis.url)
    with (
        running(workers) as (accurate, cheap),
        gateway(local_redis.url, info=info, request_timeout=120) as base,
    ):
        wait_for(lambda: live_workers(base) == 2, what="both workers' heartbeats")
        (model,) = httpx.get(f"{base}/v1/models", headers=A).json()["data"]
        assert model["id"] == "tiny" and [v["id"] for v in model["variants"]] == ["tiny-int8", "tiny-int4"]
        plain = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 2}, headers=A, timeout=60)
        assert plain.headers["x-qpack-variant"] == "tiny-int8"
        assert plain.json()["system_fingerprint"].startswith("qpack-tiny-int8-")
        pinned = httpx.post(
            f"{base}/v1/completions",
            json={**body, "max_tokens": 2, "model": "tiny-int4"},
            headers=B,
            timeout=60,
        )
        assert (
            pinned.headers["x-qpack-variant"] == "tiny-int4"
            and pinned.headers["x-qpack-worker"] == cheap.config.worker_id
        )
        answers: dict[str, list[httpx.Response]] = {"priority": [], "free": []}
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            futures = []
            for wave in range(40):
                for _ in range(6):
                    futures.append(
                        (
                            "free",
                            pool.submit(
                                httpx.post, f"{base}/v1/completions", json=body, headers=B, timeout=120
                            ),
                        )
                    )
                if wave % 4 == 0:
                    futures.append(
                        (
                            "priority",
                            pool.submit(
                                httpx.post, f"{base}/v1/completions", json=body, headers=A, timeout=120
                            ),
                        )
                    )
                time.sleep(0.1)
            for tier, future in futures:
                answers[tier].append(future.result())
        metrics = httpx.get(f"{base}/metrics").text
        knobs = redis.Redis.from_url(local_redis.url).hgetall(P.control_key("tiny"))
    assert all(r.status_code == 200 for r in answers["priority"])
    assert {r.headers["x-qpack-variant"] for r in answers["priority"]} == {"tiny-int8"}
    assert "tiny-int4" in {r.headers.get("x-qpack-variant") for r in answers["free"] if r.status_code == 200}
    assert any(r.status_code == 429 and r.json()["error"]["code"] == "overloaded" for r in answers["free"])
    assert knobs and int(knobs[b"max_num_seqs"]) in (1, 2)
    assert accurate.knobs_version and cheap.knobs_version  # both took up the controller's knobs
    assert float(knobs[b"patience"]) == accurate.patience == 5.0  # a quarter of the top tier's 20 s target
    if layout != "a variant each":
        assert accurate.config.host == cheap.config.host and accurate.engine is not cheap.engine
        assert cheap.engine.defer_to is not None  # the cheaper variant gives way to a late top-tier prompt
    assert 'qpack_fleet_slo_requests_total{model="tiny",outcome="shed",tier="free"}' in metrics
    assert 'qpack_fleet_control_decisions_total{kind="route",model="tiny"}' in metrics


def test_the_fleet_pools_capacity_only_when_every_worker_process_holds_every_build(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from serve.fleet.control import FleetControl, cohosted
    from serve.metrics import ControlMetrics

    def worker(worker_id: str, variant: str, host: str) -> P.WorkerInfo:
        kl = 0.001 if variant == "tiny-int8" else 0.02
        return P.WorkerInfo(worker_id, "tiny", "1", "hash", 4, 0, 0.0, variant=variant, kl=kl, host=host)

    both = [worker(f"w{i}", b, f"p{i // 2}") for i, b in enumerate(["tiny-int8", "tiny-int4"] * 2)]
    each = [worker("w0", "tiny-int8", "p0"), worker("w1", "tiny-int4", "p1")]
    mixed = [*both, worker("w9", "tiny-int8", "p9")]
    assert cohosted(both) and not cohosted(each) and not cohosted(mixed)
    assert not cohosted([worker("w0", "tiny-int8", "p0")])  # one variant: nothing to pool
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    control = FleetControl(
        None, ControlConfig(), TenantsSource(path), ControlMetrics(CollectorRegistry(), "t")
    )
    for workers, pooled in ((each, False), (both, True), (mixed, False)):
        loop = control.loop_for("tiny", workers)
        assert loop.controller is not None and loop.controller.config.pooled is pooled
        assert list(loop.controller.groups) == (["pool"] if pooled else ["tiny-int8", "tiny-int4"])


def test_a_gateway_reports_each_models_controller_apart(tmp_path: Path) -> None:
    """Two models behind one gateway: each model's loop writes its own series (`model` label), never the
    other's (before, both wrote one unlabelled gauge, so /metrics showed whichever ticked last)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from serve.fleet.control import FleetControl
    from serve.metrics import ControlMetrics
    from serve.tenancy.tenants import Caller

    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    registry = CollectorRegistry()
    control = FleetControl(
        None, ControlConfig(capacity=3.0), TenantsSource(path), ControlMetrics(registry, "t", per="model")
    )
    for model, variant in (("tiny", "tiny-int8"), ("other", "other-int8")):
        info = P.WorkerInfo(
            "w-" + model, model, "1", "hash", 4, 0, 0.0, variant=variant, kl=0.001, host=model
        )
        loop = control.loop_for(model, [info])
        loop.shed(Caller(tier="free", tier_rank=2))
        loop.tick()
    loop.shed(Caller(tier="free", tier_rank=2))  # a second refusal, of "other" only
    text = generate_latest(registry).decode()
    assert 't_slo_requests_total{model="tiny",outcome="shed",tier="free"} 1.0' in text
    assert 't_slo_requests_total{model="other",outcome="shed",tier="free"} 2.0' in text
    assert 't_control_capacity_rps{model="tiny"} 3.0' in text
    assert 't_control_capacity_rps{model="other"} 3.0' in text
