"""Starting fleet roles: a gateway, a worker, or both on one machine (`--role all`: a gateway here and
`--workers N` worker processes beside it, each started as `python -m serve.fleet.worker_process` with its own
options). Redis must answer at start (exit 2 with one line otherwise); later outages are waited out by every
role."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from quantize.common.errors import QpackError
from serve.fleet.gateway import Gateway, GatewayConfig, create_gateway_app
from serve.fleet.worker import FleetWorker, WorkerConfig
from serve.http import BackgroundServer, serve_app
from serve.loading import reference_name, start_engine, start_variants
from serve.metrics import Labelled
from serve.metrics import render as render_metrics
from serve.openai.errors import error_response
from serve.openai.routes import ServerInfo, metrics_refusal
from serve.options import ServeOptions, redacted
from serve.variants import prioritize


def check_redis(url: str) -> None:
    """Exit 2 (QpackError) when Redis cannot be reached: a fleet without its queue cannot start."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise QpackError(
            f"Redis at {redacted(url)} is unreachable ({exc}); start redis-server or fix `redis` "
            "(e.g. redis://127.0.0.1:6379/0)"
        ) from None


def _redis_url(options: ServeOptions) -> str:
    assert options.redis, "checked by ServeOptions.validate"
    return options.redis


def run_gateway(options: ServeOptions, info: ServerInfo, log: Callable[[str], None]) -> None:
    url = _redis_url(options)
    check_redis(url)
    gateway = Gateway(GatewayConfig(url, options.max_queue, options.request_timeout, info))
    info.tenants.reload_on_sighup(log, gateway.metrics.tenants.reloaded)
    log(f"qpack fleet gateway on http://{options.host}:{options.port} (queue: {redacted(url)})")
    serve_app(create_gateway_app(gateway), options.host, options.port)


def run_worker(options: ServeOptions, log: Callable[[str], None]) -> None:
    """The engine behind Redis until SIGTERM/SIGINT; `/health` and `/metrics` on --port. With `variants`, one
    engine per variant in this process, each a worker of its variant (`host_workers`)."""
    url = _redis_url(options)
    check_redis(url)
    workers = host_workers(options, url, log)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_args: stop.set())
    signal.signal(  # a reload sent to every `qpack serve` process must not end the workers
        signal.SIGHUP, lambda *_args: log("fleet worker: nothing to reload (tenants are the gateway's)")
    )
    server = worker_server(worker_app(workers, options.metrics_key), options.host, options.port, log)
    for worker in workers:
        log(
            f"qpack fleet worker {worker.config.worker_id}: {worker.variant} v{worker.config.version} "
            f"(queue: {redacted(url)}, port {server.port})"
        )
    threads = [
        threading.Thread(target=worker.run, args=(stop,), name=f"qpack-worker-{worker.variant}")
        for worker in workers[1:]
    ]
    with server:
        for thread in threads:
            thread.start()
        workers[0].run(stop)
        for thread in threads:
            thread.join()


def host_workers(options: ServeOptions, url: str, log: Callable[[str], None]) -> list[FleetWorker]:
    """This process's workers: one for `target`, or with `variants` one per variant, most accurate first, sharing
    this process's cores (one `host`, so the gateway pools their capacity): routing a tier to the cheaper variant
    then adds to the accurate variant's capacity instead of taking a worker from it, but their steps slow each
    other. The cheaper variants give way to a late top-tier prompt of the accurate one (`prioritize`, with the
    patience the gateway publishes)."""

    def config(name: str, variant: str, version: str, content_hash: str, kl: float) -> WorkerConfig:
        return WorkerConfig(
            url,
            name,
            version,
            content_hash,
            variant=variant,
            kl=kl,
            claim_idle_s=options.claim_idle,
            request_timeout=options.request_timeout,
            host=host,
        )

    host = f"{socket.gethostname()}-{os.getpid()}"
    if not options.variants:
        loaded, engine = start_engine(options, log)
        variant = loaded.name if options.model_name else ""
        name = options.model_name or loaded.name
        return [FleetWorker(engine, config(name, variant, loaded.version, loaded.content_hash, loaded.kl))]
    variants = start_variants(options, log)
    workers = [
        FleetWorker(s.engine, config(variants.model, s.name, s.version, s.content_hash, s.kl))
        for s in variants
    ]
    prioritize(variants, lambda: workers[0].patience)
    return workers


def worker_server(app: FastAPI, host: str, port: int, log: Callable[[str], None]) -> BackgroundServer:
    """The worker's HTTP face on `port`, or on a free one (said in the log) when something holds it: it is only
    /health and /metrics, so a taken port must not keep it from serving the queue. The port is bound here and
    held, so nothing can take it between the check and the listen."""
    server = BackgroundServer(app, port=port, host=host, any_port=True)
    if server.port != port:
        log(f"fleet worker: port {port} is in use; /health and /metrics on port {server.port} instead")
    return server


def worker_app(workers: list[FleetWorker], metrics_key: str | None = None) -> FastAPI:
    """A fleet worker process's own HTTP face: `/health` and `/metrics` (its engines', plus claims; several
    variants' engines labelled by `variant`; only for the bearer of `metrics_key` when there is one)."""
    app = FastAPI(title="qpack fleet worker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.start_draining = lambda: None

    @app.get("/health")
    async def health() -> Response:
        variants = [
            {
                "worker": w.config.worker_id,
                "variant": w.variant,
                "running": len(w.engine.scheduler.running),
                "waiting": w.engine.scheduler.num_waiting,
            }
            for w in workers
        ]
        if len(variants) == 1:
            return JSONResponse({"status": "ok", **variants[0]})
        return JSONResponse({"status": "ok", "workers": variants})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        refused = metrics_refusal(request.headers.get("authorization", "").encode(), metrics_key)
        if refused is not None:
            return error_response(refused)
        claims = sum(w.claimed for w in workers)
        if len(workers) == 1:
            engines = workers[0].engine.metrics.render()
        else:
            merged = CollectorRegistry()
            merged.register(Labelled("variant", {w.variant: w.engine.metrics.registry for w in workers}))
            engines = render_metrics(merged)
        own = f"# TYPE qpack_fleet_claims_total counter\nqpack_fleet_claims_total {claims}\n"
        return Response(engines + own.encode(), media_type="text/plain; version=0.0.4")

    return app


def worker_options(options: ServeOptions, index: int) -> ServeOptions:
    """The options of a `--role all` gateway's INDEX-th worker: the same engine limits, the targets in turn (or
    every one, `worker_variants` all; with `variants`, under the name of the model they were built from), its
    own port after the gateway's, one thread
    unless --threads says otherwise, its /health and /metrics on loopback, and no API keys or tenants (a worker
    serves no API and trusts the gateway's stamp; its options travel on a command line, so the metrics key and
    the Redis URL travel in its environment, `QPACK_METRICS_KEY` and `QPACK_REDIS_URL`, out of `ps`; the URL
    on the command line has its password as ***). The ports after the
    gateway's may be held by a client connection's local end (loopback clients take ephemeral ports): a worker
    that finds its port taken serves /health and /metrics on a free one and says which."""
    targets = (options.target or "", *options.variants)
    together = options.worker_variants == "all"
    return dataclasses.replace(
        options,
        target=targets[0] if together else targets[index % len(targets)],
        variants=options.variants if together else (),
        model_name=options.model_name or (reference_name(targets[0]) if len(targets) > 1 else None),
        role="worker",
        host="127.0.0.1",
        port=options.port + 1 + index,
        threads=options.threads or 1,
        api_keys=(),
        api_key_file=None,
        tenants_file=None,
        metrics_key=None,
        redis=redacted(options.redis) if options.redis else None,
    )


def worker_command(options: ServeOptions, index: int) -> list[str]:
    """The command line of a `--role all` gateway's INDEX-th worker: no secret on it (`ps` shows it to all)."""
    return [sys.executable, "-m", "serve.fleet.worker_process", worker_options(options, index).to_json()]


def worker_environment(options: ServeOptions) -> dict[str, str]:
    """The workers' environment: this process's, with the metrics key and the whole Redis URL."""
    secrets = {"QPACK_METRICS_KEY": options.metrics_key, "QPACK_REDIS_URL": options.redis}
    return {**os.environ, **{name: value for name, value in secrets.items() if value}}


def run_all(options: ServeOptions, info: ServerInfo, log: Callable[[str], None]) -> None:
    """A gateway here and `--workers` worker processes, each on its own port after the gateway's; with
    `variants`, the workers take the variants in turn (or each holds every variant: `worker_variants` all), answering
    to the name of the model they were built from."""
    check_redis(_redis_url(options))
    targets = (options.target or "", *options.variants)
    if options.worker_variants == "one" and options.workers < len(targets):
        raise QpackError(
            f"`workers` {options.workers} cannot serve {len(targets)} variants; give one each at least"
        )
    env = worker_environment(options)
    workers = [subprocess.Popen(worker_command(options, index), env=env) for index in range(options.workers)]
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
