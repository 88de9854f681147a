"""The batching server: continuous batching over a pooled, paged KV cache, OpenAI-compatible HTTP API.

The public names below are imported on first use, so `import serve` stays instant; the `TYPE_CHECKING` block
gives type checkers and editors the same names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from serve.core.config import SchedulerConfig
    from serve.core.request import SamplingParams
    from serve.engine.config import CacheConfig, EngineConfig, OffloadConfig, SpeculationConfig
    from serve.engine.core import Engine
    from serve.engine.output import RequestOutput
    from serve.http import BackgroundServer
    from serve.launch import run_server
    from serve.loading import build_engine, load_for_serving
    from serve.openai.routes import ServerInfo
    from serve.options import ServeOptions
    from serve.server import create_app

_EXPORTS = {
    "Engine": "serve.engine.core",
    "EngineConfig": "serve.engine.config",
    "SchedulerConfig": "serve.core.config",
    "CacheConfig": "serve.engine.config",
    "OffloadConfig": "serve.engine.config",
    "SpeculationConfig": "serve.engine.config",
    "RequestOutput": "serve.engine.output",
    "SamplingParams": "serve.core.request",
    "ServeOptions": "serve.options",
    "run_server": "serve.launch",
    "load_for_serving": "serve.loading",
    "build_engine": "serve.loading",
    "BackgroundServer": "serve.http",
    "ServerInfo": "serve.openai.routes",
    "create_app": "serve.server",
}
__all__ = [
    "BackgroundServer",
    "CacheConfig",
    "Engine",
    "EngineConfig",
    "OffloadConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "ServeOptions",
    "ServerInfo",
    "SpeculationConfig",
    "build_engine",
    "create_app",
    "load_for_serving",
    "run_server",
]

__getattr__ = lazy_exports("serve", _EXPORTS)
