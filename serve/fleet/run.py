"""Starting fleet roles: a gateway, a worker, or both on one machine (`--role all`: a gateway here and
`--workers N` worker processes beside it). Redis must answer at start (exit 2 with one line otherwise); later
outages are waited out by every role."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from quantize.common.errors import QpackError


def check_redis(url: str) -> None:
    """Exit 2 (QpackError) when Redis cannot be reached: a fleet without its queue cannot start."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise QpackError(
            f"Redis at {url} is unreachable ({exc}); start redis-server or fix --redis (e.g. redis://127.0.0.1:6379/0)"
        ) from None


def run_gateway(options: Any, info: Any, log: Callable[[str], None]) -> None:
    from serve.fleet.gateway import Gateway, GatewayConfig, create_gateway_app
    from serve.server import serve_app

    check_redis(options.redis)
    gateway = Gateway(GatewayConfig(options.redis, options.max_queue, options.request_timeout, info))
    log(f"qpack fleet gateway on http://{options.host}:{options.port} (queue: {options.redis})")
    serve_app(create_gateway_app(gateway), options.host, options.port)


def run_worker(options: Any, engine: Any, loaded: Any, log: Callable[[str], None]) -> None:
    """The engine behind Redis until SIGTERM/SIGINT; `/health` and `/metrics` on --port."""
    from serve.fleet.worker import FleetWorker, WorkerConfig
    from serve.server import BackgroundServer, worker_app

    check_redis(options.redis)
    config = WorkerConfig(
        options.redis,
        loaded.name,
        loaded.version,
        loaded.content_hash,
        claim_idle_s=options.claim_idle,
        request_timeout=options.request_timeout,
    )
    worker = FleetWorker(engine, config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_args: stop.set())
    log(f"qpack fleet worker {config.worker_id}: {loaded.name} v{loaded.version} (queue: {options.redis})")
    with BackgroundServer(worker_app(engine, worker), port=options.port, host=options.host):
        worker.run(stop)


def run_all(options: Any, info: Any, log: Callable[[str], None]) -> None:
    """A gateway here and `--workers` worker processes, each on its own port after the gateway's."""
    check_redis(options.redis)
    workers = []
    for index in range(options.workers):
        command = [
            sys.executable,
            "-m",
            "qpack",
            "serve",
            str(options.target),
            "--redis",
            options.redis,
            "--role",
            "worker",
            "--port",
            str(options.port + 1 + index),
            "--threads",
            str(options.threads or 1),
            *options.worker_args(),
        ]
        workers.append(subprocess.Popen(command))
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
