"""Tenants: who is asking (from the API key, never from the body), at which service tier, within which limits.

`tenants` reads the tenants file and resolves a key to a tenant and a request to its `Caller`; `limits` is the
token-bucket and concurrency arithmetic (pure, clock injected), kept in process by `LocalLimiter` and in Redis by
`redis_limits` for a fleet; `admission` is what both the single server and the fleet do with them per request.
"""
