"""The batching server: continuous batching over a pooled, paged KV cache, OpenAI-compatible HTTP API."""

from __future__ import annotations

from quantize.common.lazy import lazy_exports

_EXPORTS = {
    "Engine": "serve.engine",
    "EngineConfig": "serve.engine",
    "RequestOutput": "serve.engine",
    "SamplingParams": "serve.sequence",
    "ServeOptions": "serve.server",
    "run_server": "serve.server",
    "load_for_serving": "serve.server",
    "build_engine": "serve.server",
    "BackgroundServer": "serve.server",
    "ServerInfo": "serve.openai.routes",
    "create_app": "serve.openai.routes",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports("serve", _EXPORTS)
