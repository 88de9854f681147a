"""`qpack serve`: validate the options, then run the role they ask for until a signal drains it.

Roles: `single` (the default: one engine behind the OpenAI API), `gateway` (the fleet's front door, no model),
`worker` (an engine taking its work from Redis) and `all` (a gateway here and `--workers` worker processes beside
it). The fleet roles live in `serve.fleet.run`; this module only dispatches.
"""

from __future__ import annotations

from collections.abc import Callable

from serve.control.controller import ControlConfig
from serve.fleet.run import run_all, run_gateway, run_worker
from serve.http import serve_app
from serve.loading import start_variants
from serve.openai.routes import ServerInfo, docs_served
from serve.options import LOOPBACK, ServeOptions
from serve.server import create_app
from serve.tenancy.tenants import TenantsSource
from serve.variants import prioritize, top_tier_patience


def run_server(
    options: ServeOptions, log: Callable[[str], None], warn: Callable[[str], None] = lambda _m: None
) -> None:
    """Validate, then run the role. Progress goes to `log`, risks to `warn`; keys never."""
    options.validate()
    tenants = None if options.role == "worker" else TenantsSource(options.tenants_file, options.keys())
    if tenants is not None:
        if options.host not in LOOPBACK and tenants.current.open:
            warn(
                f"binding {options.host} without `api_keys` or `tenants_file`: anyone who can reach this port "
                "can use the model"
            )
        if not tenants.current.open:
            names = ", ".join(f"{t.name} ({t.tier.name})" for t in tenants.current.tenants)
            log(f"API keys required: tenants {names}")
        if len(options.keys()) > 1:
            warn(
                f"the {len(options.keys())} `api_keys` are one tenant (`default`): they share cached prefixes, "
                "sessions and limits; give each its own tenant in `tenants_file` to keep them apart"
            )
    if options.role == "worker":
        run_worker(options, log)
        return
    assert tenants is not None
    info = ServerInfo(
        "fleet",
        "",
        tenants,
        options.request_timeout,
        options.max_request_bytes,
        control=control_config(options),
        metrics_key=options.metrics_key,
        docs=docs_served(options.host, not tenants.current.open),
    )
    if options.role == "gateway":
        run_gateway(options, info, log)
    elif options.role == "all":
        run_all(options, info, log)
    else:
        _run_single(options, tenants, log)


def control_config(options: ServeOptions) -> ControlConfig | None:
    """The surge controller's settings around the configured limits (None without `control`)."""
    if not options.control:
        return None
    return ControlConfig.around(
        options.max_num_seqs, options.max_num_batched_tokens, options.prefill_chunk, options.control_capacity
    )


def _run_single(options: ServeOptions, tenants: TenantsSource, log: Callable[[str], None]) -> None:
    variants = start_variants(options, log)
    prioritize(variants, top_tier_patience(tenants.current.tiers))
    log(f"listening on http://{options.host}:{options.port} (OpenAI API under /v1; /health, /metrics)")
    info = ServerInfo(
        variants.model,
        variants.version,
        tenants,
        options.request_timeout,
        options.max_request_bytes,
        variants.primary.engine.numerics(),
        control_config(options),
        options.metrics_key,
        docs_served(options.host, not tenants.current.open),
    )
    app = create_app(variants, info)
    tenants.reload_on_sighup(log, app.state.tenant_metrics.reloaded)
    serve_app(app, options.host, options.port)
