"""Secrets and exposure: the Redis password is never logged nor put on a worker's command line; a server with
tenants on a public address does not start with an unkeyed /metrics, and shows /docs and /openapi.json only on
loopback or when it has no keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from quantize.common.errors import QpackError
from serve.fleet import run, worker_process
from serve.fleet.gateway import Gateway, GatewayConfig, create_gateway_app
from serve.http import free_port
from serve.openai.routes import ServerInfo, docs_served
from serve.options import ServeOptions, redacted
from serve.server import create_app
from tests.serve.test_api import make_engine

PASSWORD = "hunter2-s3cret"
DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


def _closed_redis(user: str = "") -> str:
    return f"redis://{user}:{PASSWORD}@127.0.0.1:{free_port()}/0"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://:{PASSWORD}@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
        (f"rediss://app:{PASSWORD}@cache.internal:6380/2", "rediss://app:***@cache.internal:6380/2"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://app@127.0.0.1:6379/0", "redis://app@127.0.0.1:6379/0"),
    ],
)
def test_a_logged_url_shows_no_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_workers_get_the_redis_url_and_metrics_key_by_environment_not_argv() -> None:
    url = f"redis://:{PASSWORD}@10.0.0.5:6379/0"
    options = ServeOptions("art/", redis=url, role="all", metrics_key="scrape-secret", workers=2)
    for index in range(2):
        command = " ".join(run.worker_command(options, index))
        assert PASSWORD not in command and "scrape-secret" not in command
        assert "redis://:***@10.0.0.5:6379/0" in command
    env = run.worker_environment(options)
    assert env["QPACK_REDIS_URL"] == url and env["QPACK_METRICS_KEY"] == "scrape-secret"


def test_a_worker_process_takes_the_url_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"redis://:{PASSWORD}@10.0.0.5:6379/0"
    options = run.worker_options(ServeOptions("art/", redis=url, role="all"), 0)
    started: list[ServeOptions] = []
    monkeypatch.setattr(worker_process, "run_worker", lambda opts, _log: started.append(opts))
    monkeypatch.setenv("QPACK_REDIS_URL", url)
    assert worker_process.main([options.to_json()]) == 0
    assert started[0].redis == url


def test_an_unreachable_redis_is_reported_without_its_password() -> None:
    with pytest.raises(QpackError) as caught:
        run.check_redis(_closed_redis())
    assert PASSWORD not in caught.value.message and ":***@127.0.0.1" in caught.value.message


def test_the_gateways_log_shows_no_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "check_redis", lambda _url: None)
    monkeypatch.setattr(run, "serve_app", lambda *_args: None)
    lines: list[str] = []
    options = ServeOptions(None, role="gateway", redis=_closed_redis("app"))
    run.run_gateway(options, ServerInfo("fleet", ""), lines.append)
    assert lines and all(PASSWORD not in line for line in lines) and "app:***@" in lines[-1]


def test_the_cli_keeps_the_password_out_of_its_errors() -> None:
    """`--redis` (or QPACK_REDIS_URL) with a password, Redis down: exit 2, one line, no password."""
    done = subprocess.run(
        [sys.executable, "-m", "qpack", "serve", "--role", "gateway", "--redis", _closed_redis()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "unreachable" in done.stderr, done.stderr
    assert PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize("role", ["single", "gateway", "all"])
def test_tenants_on_a_public_address_need_a_metrics_key(role: str, tmp_path: Path) -> None:
    fleet: dict[str, Any] = {} if role == "single" else {"redis": "redis://127.0.0.1:6379/0"}
    target = None if role == "gateway" else "art/"
    public = ServeOptions(target, host="0.0.0.0", tenants_file=tmp_path / "t.toml", role=role, **fleet)
    with pytest.raises(QpackError, match=r"metrics_key.*--metrics-key.*--host 127.0.0.1"):
        public.validate()
    ServeOptions(
        target, host="0.0.0.0", tenants_file=tmp_path / "t.toml", metrics_key="k", role=role, **fleet
    ).validate()
    ServeOptions(target, host="127.0.0.1", tenants_file=tmp_path / "t.toml", role=role, **fleet).validate()
    ServeOptions(target, host="0.0.0.0", role=role, **fleet).validate()  # open server: warned, not refused


def test_the_cli_refuses_an_unkeyed_metrics_on_a_public_address_in_one_line(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\nkeys = ["k"]\n')
    gateway = ["--role", "gateway", "--redis", "redis://127.0.0.1:1/0"]
    done = subprocess.run(
        [sys.executable, "-m", "qpack", "serve", *gateway, "--host", "0.0.0.0", "--tenants", str(tenants)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "--metrics-key" in lines[0], done.stderr


def test_docs_are_served_on_loopback_or_without_keys_only() -> None:
    assert docs_served("127.0.0.1", keyed=True) and docs_served("::1", keyed=True)
    assert docs_served("0.0.0.0", keyed=False)
    assert not docs_served("0.0.0.0", keyed=True) and not docs_served("10.1.2.3", keyed=True)


@pytest.mark.parametrize("docs", [True, False])
def test_the_gateway_serves_docs_only_when_allowed(docs: bool) -> None:
    info = ServerInfo("fleet", "", docs=docs)
    app = create_gateway_app(Gateway(GatewayConfig(f"redis://127.0.0.1:{free_port()}/0", info=info)))
    client = TestClient(app)
    for path in DOC_PATHS:
        assert client.get(path).status_code == (200 if docs else 404), path


def test_the_server_serves_docs_only_when_allowed_and_a_worker_never(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    hidden = TestClient(create_app(engine, ServerInfo("tiny", "1", docs=False)))
    shown = TestClient(create_app(engine, ServerInfo("tiny", "1")))
    for path in DOC_PATHS:
        assert hidden.get(path).status_code == 404 and shown.get(path).status_code == 200, path
    assert json.loads(shown.get("/openapi.json").text)["info"]["title"] == "qpack serve"
    worker = TestClient(run.worker_app([]))
    for path in DOC_PATHS:
        assert worker.get(path).status_code == 404, path
