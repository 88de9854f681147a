"""Serving past one process: gateways and engine workers behind Redis streams (see `wire`: the messages on Redis)."""
