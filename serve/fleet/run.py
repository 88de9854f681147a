"""Starting fleet roles: a gateway, a worker, or both on one machine (`--role all`: a gateway here and
`--workers N` worker processes beside it, each started as `python -m serve.fleet.worker_process` with its own
options). Redis must answer at start (exit 2 with one line otherwise); later outages are waited out by every
role."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from quantize.common.errors import QpackError
from serve.fleet.gateway import Gateway, GatewayConfig, create_gateway_app
from serve.fleet.worker import FleetWorker, WorkerConfig
from serve.http import BackgroundServer, free_port, port_in_use, serve_app
from serve.loading import reference_name, start_engine
from serve.openai.errors import error_response
from serve.openai.routes import ServerInfo, metrics_refusal
from serve.options import ServeOptions


def check_redis(url: str) -> None:
    """Exit 2 (QpackError) when Redis cannot be reached: a fleet without its queue cannot start."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise QpackError(
            f"Redis at {url} is unreachable ({exc}); start redis-server or fix `redis` (e.g. redis://127.0.0.1:6379/0)"
        ) from None


def _redis_url(options: ServeOptions) -> str:
    assert options.redis, "checked by ServeOptions.validate"
    return options.redis


def run_gateway(options: ServeOptions, info: ServerInfo, log: Callable[[str], None]) -> None:
    url = _redis_url(options)
    check_redis(url)
    gateway = Gateway(GatewayConfig(url, options.max_queue, options.request_timeout, info))
    info.tenants.reload_on_sighup(log, gateway.metrics.tenants.reloaded)
    log(f"qpack fleet gateway on http://{options.host}:{options.port} (queue: {url})")
    serve_app(create_gateway_app(gateway), options.host, options.port)


def run_worker(options: ServeOptions, log: Callable[[str], None]) -> None:
    """The engine behind Redis until SIGTERM/SIGINT; `/health` and `/metrics` on --port."""
    url = _redis_url(options)
    check_redis(url)
    loaded, engine = start_engine(options, log)
    config = WorkerConfig(
        url,
        options.model_name or loaded.name,
        loaded.version,
        loaded.content_hash,
        variant=loaded.name if options.model_name else "",
        kl=loaded.kl,
        claim_idle_s=options.claim_idle,
        request_timeout=options.request_timeout,
    )
    worker = FleetWorker(engine, config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_args: stop.set())
    signal.signal(  # a reload sent to every `qpack serve` process must not end the workers
        signal.SIGHUP, lambda *_args: log("fleet worker: nothing to reload (tenants are the gateway's)")
    )
    port = worker_port(options.host, options.port, log)
    log(f"qpack fleet worker {config.worker_id}: {loaded.name} v{loaded.version} (queue: {url}, port {port})")
    with BackgroundServer(worker_app(worker, options.metrics_key), port=port, host=options.host):
        worker.run(stop)


def worker_port(host: str, port: int, log: Callable[[str], None]) -> int:
    """`port`, or a free one (said in the log) when something holds it: a worker's HTTP face is only its /health
    and /metrics, so a taken port must not keep it from serving the queue."""
    if not port_in_use(host, port):
        return port
    chosen = free_port()
    log(f"fleet worker: port {port} is in use; /health and /metrics on port {chosen} instead")
    return chosen


def worker_app(worker: FleetWorker, metrics_key: str | None = None) -> FastAPI:
    """A fleet worker's own HTTP face: `/health` and `/metrics` (the engine's, plus claims; only for the bearer
    of `metrics_key` when there is one)."""
    engine = worker.engine
    app = FastAPI(title="qpack fleet worker")
    app.state.start_draining = lambda: None

    @app.get("/health")
    async def health() -> Response:
        load = {"running": len(engine.scheduler.running), "waiting": engine.scheduler.num_waiting}
        return JSONResponse({"status": "ok", "worker": worker.config.worker_id, **load})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        refused = metrics_refusal(request.headers.get("authorization", "").encode(), metrics_key)
        if refused is not None:
            return error_response(refused)
        claims = f"# TYPE qpack_fleet_claims_total counter\nqpack_fleet_claims_total {worker.claimed}\n"
        return Response(engine.metrics.render() + claims.encode(), media_type="text/plain; version=0.0.4")

    return app


def worker_options(options: ServeOptions, index: int) -> ServeOptions:
    """The options of a `--role all` gateway's INDEX-th worker: the same engine limits, the targets in turn (with
    `variants`, under the name of the model they were built from), its own port after the gateway's, one thread
    unless --threads says otherwise, its /health and /metrics on loopback, and no API keys or tenants (a worker
    serves no API and trusts the gateway's stamp; its options travel on a command line, so the metrics key
    travels in its environment, `QPACK_METRICS_KEY`, out of `ps`). The ports after the
    gateway's may be held by a client connection's local end (loopback clients take ephemeral ports): a worker
    that finds its port taken serves /health and /metrics on a free one and says which."""
    targets = (options.target or "", *options.variants)
    return dataclasses.replace(
        options,
        target=targets[index % len(targets)],
        variants=(),
        model_name=options.model_name or (reference_name(targets[0]) if len(targets) > 1 else None),
        role="worker",
        host="127.0.0.1",
        port=options.port + 1 + index,
        threads=options.threads or 1,
        api_keys=(),
        api_key_file=None,
        tenants_file=None,
        metrics_key=None,
    )


def run_all(options: ServeOptions, info: ServerInfo, log: Callable[[str], None]) -> None:
    """A gateway here and `--workers` worker processes, each on its own port after the gateway's; with
    `variants`, the workers take the targets in turn and answer to the name of the model they were built from."""
    check_redis(_redis_url(options))
    targets = (options.target or "", *options.variants)
    if options.workers < len(targets):
        raise QpackError(
            f"`workers` {options.workers} cannot serve {len(targets)} variants; give one each at least"
        )
    env = {**os.environ, **({"QPACK_METRICS_KEY": options.metrics_key} if options.metrics_key else {})}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "serve.fleet.worker_process", worker_options(options, index).to_json()],
            env=env,
        )
        for index in range(options.workers)
    ]
    log(f"started {len(workers)} workers (pids {', '.join(str(w.pid) for w in workers)})")
    try:
        run_gateway(options, info, log)
    finally:
        for worker in workers:
            worker.terminate()
        deadline = time.monotonic() + 60
        for worker in workers:
            try:
                worker.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
