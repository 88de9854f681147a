"""The surge controller in a real server over two variants of one tiny model (int8 and int4 artifacts): answers say
which variant computed them, a request may pin one, `/v1/models` and `/metrics` list both, and a burst moves the
free tier onto the cheaper variant, and sheds it, while the priority tier stays on the accurate one, unrefused."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import httpx
import pytest

from quantize.config import QuantizeConfig
from quantize.formats.schemes import Int4, Int8
from quantize.pipeline import quantize_model
from quantize.sensitivity.settings import SensitivityConfig
from serve.control.controller import ControlConfig
from serve.engine import loop
from serve.engine.controls import EngineControls
from serve.engine.protocol import Knobs
from serve.http import BackgroundServer
from serve.loading import build_engine, load_for_serving
from serve.openai import ServerInfo
from serve.tenancy.tenants import TenantsSource
from serve.variants import Served, Variants, prioritize
from tests.serve.engines import config_from_options

TENANTS = """\
[[tiers]]
name = "priority"
service_tier = "priority"
ttft_ms = 20000
[[tiers]]
name = "standard"
max_kl = 0.0
ttft_ms = 20000
[[tiers]]
name = "free"
service_tier = "flex"
ttft_ms = 8000

[tenants.acme]
keys = ["key-a"]
tier = "priority"

[tenants.globex]
keys = ["key-b"]
tier = "free"
"""
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def artifacts(tiny_llama_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, scheme in (("tiny-int8", Int8()), ("tiny-int4", Int4(32))):
        folder = tmp_path_factory.mktemp(name) / "art"
        quantize_model(
            QuantizeConfig(
                output=folder,
                calibration=tiny_llama_calibration,
                name=name,
                overrides={"_default": scheme},
                sensitivity=SensitivityConfig(num_tokens=64),
                calib_tokens=256,
                eval_tokens=128,
            )
        )
        out[name] = folder
    return out


def variants(artifacts: dict[str, Path], **engine: object) -> Variants:
    config = config_from_options(**{"block_size": 4, "kv_memory": "16MB", "max_model_len": 256, **engine})
    served = []
    for path in artifacts.values():
        loaded = load_for_serving(str(path))
        served.append(
            Served(loaded.name, loaded.version, loaded.kl, loaded.content_hash, build_engine(loaded, config))
        )
    held = Variants("tiny", "1", served)
    prioritize(held)
    return held


def test_the_cheaper_variant_gives_way_while_a_top_tier_prompt_waits_on_the_accurate_one(
    artifacts: dict[str, Path],
) -> None:
    from serve.core.request import Owner, SamplingParams

    held = variants(artifacts)
    accurate, cheap = held.primary.engine, held["tiny-int4"].engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    done = {name: threading.Event() for name in ("top", "free")}

    def finished(name: str):  # type: ignore[no-untyped-def]
        return lambda output: done[name].set() if output.finished else None

    accurate.add("top", list(range(3, 30)), params, finished("top"), owner=Owner("p", "priority", 0))
    cheap.add("free", list(range(3, 30)), params, finished("free"), owner=Owner("f", "free", 2))
    assert EngineControls(accurate).top_tier_pending() and not EngineControls(cheap).top_tier_pending()
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(cheap, stop), daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        assert cheap.stats.steps == 0  # the accurate engine has not stepped: its top-tier prompt still waits
        assert done["free"].wait(30)  # but never for more than a second at a time
        accurate.step()
        assert not EngineControls(accurate).top_tier_pending()
    finally:
        stop.set()
        thread.join(timeout=30)


def test_answers_name_their_variant_and_a_request_may_pin_one(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    held = variants(artifacts)
    assert held.names == ["tiny-int8", "tiny-int4"]  # most accurate (least KL) first
    assert held.primary.kl < held["tiny-int4"].kl
    with BackgroundServer(held, ServerInfo("tiny", "1")) as url:
        body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert plain.headers["x-qpack-variant"] == "tiny-int8"
        assert (
            plain.json()["system_fingerprint"] == held.primary.fingerprint and plain.json()["model"] == "tiny"
        )
        pinned = httpx.post(f"{url}/v1/completions", json={**body, "model": "tiny-int4"}, timeout=60)
        assert pinned.headers["x-qpack-variant"] == "tiny-int4"
        assert pinned.json()["system_fingerprint"].startswith("qpack-tiny-int4-")
        assert httpx.post(f"{url}/v1/completions", json={**body, "model": "nope"}).status_code == 404
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
            assert response.headers["x-qpack-variant"] == "tiny-int8"
            assert all(
                '"system_fingerprint": "qpack-tiny-int8' in line
                for line in response.iter_lines()
                if line.startswith("data: {")
            )
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-int8", "tiny-int4"]
        assert [v["id"] for v in models[0]["variants"]] == ["tiny-int8", "tiny-int4"]
        metrics = httpx.get(f"{url}/metrics").text
        assert (
            'variant="tiny-int4"' in metrics
            and 'qpack_variant_requests_total{tier="standard",variant="tiny-int4"} 1.0' in metrics
        )


def test_a_burst_moves_the_free_tier_and_never_the_priority_tier(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    held = variants(artifacts, max_num_seqs=2, max_num_batched_tokens=64)
    control = ControlConfig(
        tick=0.1, horizon=0.5, latency=Knobs(1, 64, 32), throughput=Knobs(2, 64, 32), dwell=1.0, capacity=5.0
    )
    info = ServerInfo("tiny", "1", TenantsSource(path), request_timeout=120, control=control)
    body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    answers: dict[str, list[httpx.Response]] = {"priority": [], "free": []}
    with BackgroundServer(held, info) as url, concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures = []
        for wave in range(40):  # 4 s of 60 requests/s, several times what batches of 2 finish
            for _ in range(6):
                futures.append(
                    (
                        "free",
                        pool.submit(httpx.post, f"{url}/v1/completions", json=body, headers=B, timeout=120),
                    )
                )
            if wave % 4 == 0:
                futures.append(
                    (
                        "priority",
                        pool.submit(httpx.post, f"{url}/v1/completions", json=body, headers=A, timeout=120),
                    )
                )
            time.sleep(0.1)
        for tier, future in futures:
            answers[tier].append(future.result())
        metrics = httpx.get(f"{url}/metrics").text
    assert all(r.status_code == 200 for r in answers["priority"])  # never refused
    assert {r.headers["x-qpack-variant"] for r in answers["priority"]} == {"tiny-int8"}  # never moved
    free_variants = {r.headers.get("x-qpack-variant") for r in answers["free"] if r.status_code == 200}
    assert "tiny-int4" in free_variants  # moved to the cheaper variant under the burst
    shed = [r for r in answers["free"] if r.status_code == 429]
    assert shed and all(int(r.headers["retry-after"]) >= 1 for r in shed)
    assert 'qpack_control_mode{mode="throughput"}' in metrics
    assert 'qpack_slo_requests_total{outcome="shed",tier="free"}' in metrics
    assert 'qpack_control_decisions_total{kind="route"}' in metrics
    assert 'qpack_slo_attainment{tier="priority"}' in metrics
