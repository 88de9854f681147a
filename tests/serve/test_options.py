"""`ServeOptions` as a `--role all` gateway hands them to its workers: JSON there and back, and the worker
process's own entry point refusing what it cannot run in one line."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from quantize.common.errors import QpackError
from serve.fleet.run import worker_options, worker_server
from serve.http import BackgroundServer, free_port
from serve.options import ServeOptions


def test_options_round_trip_through_json() -> None:
    options = ServeOptions(
        "art/",
        port=9000,
        api_keys=("k1", "k2"),
        api_key_file=Path("/keys"),
        max_model_len=256,
        prefill_dtype="bfloat16",
        session_ttl=30.0,
        redis="redis://127.0.0.1:6379/0",
        role="all",
    )
    assert ServeOptions.from_json(options.to_json()) == options


def test_unknown_and_missing_fields_are_named_at_once() -> None:
    with pytest.raises(
        QpackError, match="unknown field 'colour'; unknown field 'size'; missing field 'target'"
    ):
        ServeOptions.from_json('{"colour": 1, "size": 2}')
    with pytest.raises(QpackError, match="JSON object"):
        ServeOptions.from_json("[1]")


def test_a_gateways_workers_get_its_engine_options_on_their_own_ports_without_keys() -> None:
    gateway = ServeOptions(
        "art/",
        host="0.0.0.0",
        port=8000,
        api_keys=("secret",),
        metrics_key="scrape-secret",
        kv_memory="1GB",
        prefill_dtype="bfloat16",
        isolate_users=True,
        redis="redis://r/0",
        role="all",
        workers=2,
    )
    second = worker_options(gateway, 1)
    assert (second.role, second.port, second.host, second.threads) == ("worker", 8002, "127.0.0.1", 1)
    assert second.api_keys == () and "secret" not in second.to_json()  # the metrics key goes by environment
    assert (second.kv_memory, second.prefill_dtype, second.isolate_users) == ("1GB", "bfloat16", True)
    second.validate()


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        ('{"target": null, "role": "worker", "redis": "redis://r/0"}', "artifact or model"),
        ('{"target": "art/", "role": "gateway", "redis": "redis://r/0"}', "runs --role worker"),
        ("not json", "not JSON"),
    ],
)
def test_the_worker_process_refuses_in_one_line(argument: str, expected: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "serve.fleet.worker_process", argument],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1 and expected in lines[0], run.stderr


def test_role_all_gives_every_worker_every_build_or_the_builds_in_turn(tmp_path: Path) -> None:
    """`qpack serve A B --role all --workers 3`: the workers take the builds in turn (`--worker-variants all`:
    every worker holds both), each answering to the name of the model they were built from (read from A's
    manifest, no weights loaded)."""
    import json

    builds = []
    for name in ("m-int8", "m-int4"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "manifest.json").write_text(
            json.dumps({"name": name, "source": {"model_id": "org/base-model"}})
        )
        builds.append(str(folder))
    options = ServeOptions(builds[0], variants=(builds[1],), role="all", workers=3, redis="redis://x/0")
    together = [worker_options(dataclasses.replace(options, worker_variants="all"), i) for i in range(3)]
    assert all((w.target, w.variants, w.role) == (builds[0], (builds[1],), "worker") for w in together)
    assert {w.model_name for w in together} == {"base-model"}
    for w in together:
        w.validate()
    in_turn = [worker_options(options, i) for i in range(3)]
    assert [w.target for w in in_turn] == [builds[0], builds[1], builds[0]]
    assert {w.model_name for w in in_turn} == {"base-model"} and all(w.variants == () for w in in_turn)
    single = worker_options(ServeOptions(builds[0], role="all", redis="redis://x/0"), 0)
    assert single.model_name is None  # one build: the artifact's own name, as before
    with pytest.raises(QpackError, match="variants"):
        ServeOptions(builds[0], variants=(builds[1],), role="gateway", redis="redis://x/0").validate()
    with pytest.raises(QpackError, match="worker_variants"):
        dataclasses.replace(options, worker_variants="some").validate()


def test_a_worker_whose_port_is_taken_serves_its_health_on_a_free_one() -> None:
    """`--role all` gives workers the ports after the gateway's, where a loopback client's connection may sit;
    the port chosen is bound at once and held (no window for another process to take it)."""
    from fastapi import FastAPI

    said: list[str] = []
    app = FastAPI()
    app.state.start_draining = lambda: None
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        server = worker_server(app, "127.0.0.1", port, said.append)
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is in use"):
            BackgroundServer(app, port=port)
    assert server.port != port and said == [
        f"fleet worker: port {port} is in use; /health and /metrics on port {server.port} instead"
    ]
    with socket.socket() as late, pytest.raises(OSError):  # held from the moment it was chosen
        late.bind(("127.0.0.1", server.port))
    with server as url:
        assert httpx.get(f"{url}/docs", timeout=5).status_code == 200
    free = worker_server(app, "127.0.0.1", port, said.append)
    assert free.port == port and len(said) == 1
    with free:
        pass


def test_speculative_options_are_checked_together() -> None:
    bad = ServeOptions(
        "art/", speculative="draft", speculative_k=0, speculative_max_batch=0, draft_kv_memory="lots"
    )
    with pytest.raises(QpackError) as caught:
        bad.validate()
    message = str(caught.value)
    for field in ("draft", "speculative_k", "speculative_max_batch", "draft_kv_memory"):
        assert field in message, field
    with pytest.raises(QpackError, match="speculative"):
        ServeOptions("art/", speculative="fast").validate()
    ServeOptions("art/", speculative="auto", draft="int4").validate()
