"""KV offload below the paged pool: a host-memory store and a disk store, for returning conversations."""
