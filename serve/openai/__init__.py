"""The OpenAI-compatible HTTP API: `protocol` (request parsing and validation, no server needed), `prompts`
(token ids), `render` (responses and SSE chunks), `answers` (the SSE stream and the engine's refusals, shared with
the fleet), `generation` (a request from its body to its answer), `routes` (the routes and their guard;
`serve.server` runs them over the engines).

The names below are imported on first use: the protocol modules are imported by layers under the routes (the
surge controller, the fleet), which must not pull the routes in with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from serve.openai.protocol import ApiError, GenerationRequest, parse_request, sampling_params
    from serve.openai.routes import ServerInfo

_EXPORTS = {
    "ApiError": "serve.openai.protocol",
    "GenerationRequest": "serve.openai.protocol",
    "parse_request": "serve.openai.protocol",
    "sampling_params": "serve.openai.protocol",
    "ServerInfo": "serve.openai.routes",
}
__all__ = ["ApiError", "GenerationRequest", "ServerInfo", "parse_request", "sampling_params"]

__getattr__ = lazy_exports("serve.openai", _EXPORTS)
