"""The batching server: continuous batching over a pooled, paged KV cache, OpenAI-compatible HTTP API."""
