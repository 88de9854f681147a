"""The OpenAI server as it runs: the routes (`serve.openai.routes`) over one engine or several variants of one model,
and what starts and stops around them. Each variant's engine steps on a thread of its own and the surge
controller's loop on another, from start-up; at shutdown the server drains (health 503, new requests refused,
running ones finish), then the threads stop and the engines write out their KV offload. The launcher
(`serve.launch`), the fleet and the tests build servers here; the routes only answer requests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from serve.control.controller import Controller, Decision, Variant
from serve.control.loop import ControlLoop, policies
from serve.engine import loop
from serve.engine.core import Engine
from serve.engine.protocol import Load
from serve.metrics import ControlMetrics, TenantMetrics
from serve.openai.errors import internal_error
from serve.openai.generation import Generation
from serve.openai.routes import Guard, ServerInfo, Sessions, add_routes, fastapi_app
from serve.variants import Variants


def create_app(target: Engine | Variants, info: ServerInfo) -> FastAPI:
    """The API over one engine, or over several variants of one model (each its own engine, on its own thread),
    with the surge controller's loop beside them when `info.control` asks for one."""
    variants = target if isinstance(target, Variants) else Variants.single(target, info.name, info.version)
    registry = CollectorRegistry()
    tenant_metrics, control_metrics = TenantMetrics(registry, "qpack"), ControlMetrics(registry, "qpack")
    control = control_loop(variants, info, control_metrics)
    generation = Generation(variants, info.tenants, control, tenant_metrics, info.request_timeout)
    sessions = Sessions([served.engine for served in variants], info.tenants, generation.door)
    state: dict[str, Any] = {"draining": False, "threads": [], "sessions": sessions}
    app = fastapi_app("qpack serve", info, lifespan=_lifespan(variants, control, generation, state))
    app.state.variants = variants
    app.state.info = info
    app.state.control = control
    app.state.tenant_metrics = tenant_metrics
    app.state.server_state = state
    app.state.start_draining = lambda: state.update(draining=True)
    app.add_middleware(Guard, info=info, draining=lambda: bool(state["draining"]))
    app.add_exception_handler(Exception, internal_error)
    add_routes(app, variants, info, generation, sessions, registry, lambda: bool(state["draining"]))
    return app


def _lifespan(
    variants: Variants, control: ControlLoop, generation: Generation, state: dict[str, Any]
) -> Callable[[FastAPI], Any]:
    """Each variant's engine on a thread and the controller's loop on another, from start-up; at shutdown,
    requests finish (the server drains), then the threads stop and the engines write out their KV offload."""
    stop_event = threading.Event()
    engines = [served.engine for served in variants]

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        threads = [
            threading.Thread(
                target=loop.run, args=(s.engine, stop_event), name=f"qpack-engine-{s.name}", daemon=True
            )
            for s in variants
        ]
        threads.append(
            threading.Thread(target=control.run, args=(stop_event,), name="qpack-control", daemon=True)
        )
        for thread in threads:
            thread.start()
        state["threads"] = threads
        try:
            yield
        finally:
            state["draining"] = True
            while any(e.has_work() for e in engines):
                await asyncio.sleep(0.05)
            stop_event.set()
            for engine in engines:
                engine.wake()
            for thread in threads:
                thread.join(timeout=10)
            generation.shutdown()
            state["sessions"].shutdown()
            for engine in engines:
                engine.close()

    return lifespan


def control_loop(variants: Variants, info: ServerInfo, metrics: ControlMetrics) -> ControlLoop:
    """The controller's loop over these variants (without `info.control`: the ledger and its metrics only)."""
    tiers = info.tenants.current.tiers
    controller = None
    if info.control is not None:
        controller = Controller(info.control, policies(tiers), [Variant(s.name, s.kl) for s in variants])

    engines = variants.controlled()

    def loads() -> dict[str, Load]:
        return {name: engine.load() for name, engine in engines.items()}

    def apply(decision: Decision) -> None:
        for engine in engines.values():
            engine.configure(decision.knobs)

    return ControlLoop(tiers, variants.names, loads, apply, metrics, controller)
