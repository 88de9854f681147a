"""The OpenAI-compatible HTTP API: `protocol` (request parsing and validation, no server needed), `prompts`
(token ids), `render` (responses and SSE chunks), `answers` (the SSE stream and the engine's refusals, shared with
the fleet), `routes` (the FastAPI app over the engine)."""

from __future__ import annotations

from serve.openai.protocol import ApiError, GenerationRequest, parse_request, sampling_params
from serve.openai.routes import ServerInfo, create_app

__all__ = ["ApiError", "GenerationRequest", "ServerInfo", "create_app", "parse_request", "sampling_params"]
