"""The names of the KV cache's formats: the element types of the paged pool and the codecs of stored KV blocks.

Declared here, below both their users and the command line: `kv_cache.py` and `tiers/codec.py` map them onto
torch dtypes and compressors, and `options.py` validates `--kv-dtype` and `--kv-codec` against them without
importing torch (so `qpack --help` stays instant) and without the KV code reaching up into the CLI's options.
"""

from __future__ import annotations

KV_DTYPE_NAMES = ("float32", "bfloat16", "float16")
CODECS = (
    "zstd",
    "zlib",
    "lz4",
    "none",
)  # of stored KV blocks (serve/offload/codec.py), by their stored index
