"""`qpack serve`: validate the options, then run the role they ask for until a signal drains it.

Roles: `single` (the default: one engine behind the OpenAI API), `gateway` (the fleet's front door, no model),
`worker` (an engine taking its work from Redis) and `all` (a gateway here and `--workers` worker processes beside
it). The fleet roles live in `serve.fleet.run`; this module only dispatches.
"""

from __future__ import annotations

from collections.abc import Callable

from serve.fleet.run import run_all, run_gateway, run_worker
from serve.http import serve_forever
from serve.loading import start_engine
from serve.openai.routes import ServerInfo
from serve.options import LOOPBACK, ServeOptions


def run_server(
    options: ServeOptions, log: Callable[[str], None], warn: Callable[[str], None] = lambda _m: None
) -> None:
    """Validate, then run the role. Progress goes to `log`, risks to `warn`; keys never."""
    options.validate()
    keys = options.keys()
    if options.host not in LOOPBACK and not keys:
        warn(f"binding {options.host} without `api_keys`: anyone who can reach this port can use the model")
    if keys:
        log(f"API keys required: {len(keys)} accepted")
    info = ServerInfo("fleet", "", keys, options.request_timeout, options.max_request_bytes)
    if options.role == "gateway":
        run_gateway(options, info, log)
    elif options.role == "all":
        run_all(options, info, log)
    elif options.role == "worker":
        run_worker(options, log)
    else:
        _run_single(options, keys, log)


def _run_single(options: ServeOptions, keys: tuple[str, ...], log: Callable[[str], None]) -> None:
    loaded, engine = start_engine(options, log)
    log(f"listening on http://{options.host}:{options.port} (OpenAI API under /v1; /health, /metrics)")
    info = ServerInfo(
        loaded.name,
        loaded.version,
        keys,
        options.request_timeout,
        options.max_request_bytes,
        engine.numerics(),
    )
    serve_forever(engine, info, options.host, options.port)
