"""The engine core's parts, below everything else in `serve`: the scheduler, the KV cache manager and the block
pool under it, requests, the paged-KV model runner and its pool geometry, the sampler, and their settings
(`config`). Nothing here imports the engine, the front ends (`openai`, `fleet`), the controller, tenancy or the
command line's options; `tests/test_layering.py` holds that rule."""
