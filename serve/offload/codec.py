"""One KV block as bytes for the host-memory and disk stores: a self-describing header, then the compressed
K and V of every layer for the block's tokens.

A stored block must never be served to the wrong model, dtype or layout, nor be served damaged: the header
carries the format version, the artifact's content hash, the KV dtype, the block size, the layer count and head
shape, the block's own chain key (so a file renamed onto another key is refused), the codec, the payload and raw
lengths, and a BLAKE2b checksum of the payload. `decode` checks every field against what the engine expects and
raises `CorruptBlock` naming the first mismatch; the caller counts it, deletes the entry and recomputes.

Compression (measured on SmolLM2 int8 KV blocks from ShareGPT prompts, 2 cores; `benchmarks/sessions.py` and
the issue note): raw KV bytes barely compress (zstd-1: FP32 1.07x, bf16 1.25x; lz4 1.0x), because a float's
low mantissa bytes are noise. Regrouping the bytes by significance first (byte shuffle, as Blosc does) lets the
exponent bytes compress: shuffle + zstd level 1 reached FP32 1.16x and bf16 1.32x at ~110 MB/s each way, where
zlib (the design's first choice) gave the same ratio at ~10-15 MB/s: a 368 KB SmolLM2 FP32 block costs ~3 ms to
load, against ~20 ms to recompute its 8 tokens. So the default is shuffle + zstd-1; zlib, lz4 and none remain.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from serve.kv_formats import CODECS

MAGIC = b"QPKV"
FORMAT_VERSION = 1
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_OF = {code: dtype for dtype, code in _DTYPES.items()}
# magic, version, codec, dtype, block size, layers, kv heads, head dim, model hash, key, payload, raw, checksum
_HEADER = struct.Struct("<4sHBBIIII32s32sQQ16s")


class CorruptBlock(ValueError):
    """A stored block that is truncated, damaged, foreign (another model, dtype or layout) or not its key's."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block of one engine looks like; a stored block must match it exactly."""

    model_hash: bytes  # 32 bytes: the artifact's content hash
    dtype: torch.dtype
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[2 * layers, block_size, kv_heads, head_dim]: K of every layer, then V of every layer."""
        return (2 * self.layers, self.block_size, self.kv_heads, self.head_dim)

    @property
    def raw_bytes(self) -> int:
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * element


def encode(layout: BlockLayout, key: bytes, block: torch.Tensor, codec: str = "zstd") -> bytes:
    """block [2 * layers, block_size, kv_heads, head_dim] in `layout.dtype` -> header + payload."""
    assert tuple(block.shape) == layout.shape and block.dtype == layout.dtype, (block.shape, block.dtype)
    raw = block.contiguous().view(torch.uint8).reshape(-1)
    payload = _compress(codec, _shuffle(raw, block.element_size()))
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        CODECS.index(codec),
        _DTYPES[layout.dtype],
        layout.block_size,
        layout.layers,
        layout.kv_heads,
        layout.head_dim,
        layout.model_hash,
        key,
        len(payload),
        raw.numel(),
        hashlib.blake2b(payload, digest_size=16).digest(),
    )
    return header + payload


def decode(layout: BlockLayout, key: bytes, data: bytes) -> torch.Tensor:
    """The block tensor, or CorruptBlock naming why it cannot be this engine's block for `key`."""
    if len(data) < _HEADER.size:
        raise CorruptBlock(f"truncated: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    fields = _HEADER.unpack_from(data)
    magic, version, codec, dtype, block_size, layers, kv_heads, head_dim, model, stored_key = fields[:10]
    payload_bytes, raw_bytes, checksum = fields[10:]
    expected = (MAGIC, FORMAT_VERSION, _DTYPES[layout.dtype], layout.block_size, layout.layers)
    for name, got, want in zip(
        ("magic", "format version", "dtype", "block size", "layers"),
        (magic, version, dtype, block_size, layers),
        expected,
        strict=True,
    ):
        if got != want:
            raise CorruptBlock(f"foreign block: {name} {got!r}, expected {want!r}")
    if (kv_heads, head_dim) != (layout.kv_heads, layout.head_dim):
        raise CorruptBlock(
            f"foreign block: heads {kv_heads}x{head_dim}, expected {layout.kv_heads}x{layout.head_dim}"
        )
    if model != layout.model_hash:
        raise CorruptBlock("foreign block: written for another model version")
    if stored_key != key:
        raise CorruptBlock("the block is stored under another key")
    payload = _payload(data, payload_bytes, checksum)
    if codec >= len(CODECS) or raw_bytes != layout.raw_bytes:
        raise CorruptBlock(f"bad codec {codec} or raw size {raw_bytes}")
    element = torch.empty(0, dtype=layout.dtype).element_size()
    try:
        unpacked = _decompress(CODECS[codec], payload, raw_bytes)
    except Exception as exc:  # a codec error on bytes whose checksum matched: refuse, never guess
        raise CorruptBlock(f"payload does not decompress ({exc})") from None
    if len(unpacked) != raw_bytes:
        raise CorruptBlock(f"payload decompresses to {len(unpacked)} bytes, not {raw_bytes}")
    return _unshuffle(unpacked, element).view(layout.dtype).reshape(layout.shape)


def intact(data: bytes) -> bool:
    """The stored bytes are whole and match their checksum (no layout checks: a scrub of the disk store's files)."""
    if len(data) < _HEADER.size or data[:4] != MAGIC:
        return False
    fields = _HEADER.unpack_from(data)
    try:
        _payload(data, fields[10], fields[12])
    except CorruptBlock:
        return False
    return True


def _payload(data: bytes, payload_bytes: int, checksum: bytes) -> bytes:
    """The payload after the header, or CorruptBlock when it is cut short or fails its checksum."""
    payload = data[_HEADER.size :]
    if len(payload) != payload_bytes:
        raise CorruptBlock(f"truncated: payload {len(payload)} bytes of {payload_bytes}")
    if hashlib.blake2b(payload, digest_size=16).digest() != checksum:
        raise CorruptBlock("checksum mismatch")
    return payload


def _shuffle(raw: torch.Tensor, width: int) -> bytes:
    """Bytes regrouped by significance: all first bytes of the elements, then all second bytes, ...
    (numpy's strided copy: ~10x torch's on a 368 KB block, which sits on every offload load's path)."""
    return raw.numpy().reshape(-1, width).T.copy().tobytes()


def _unshuffle(data: bytes, width: int) -> torch.Tensor:
    planes = np.frombuffer(data, dtype=np.uint8).reshape(width, -1)
    elements = np.empty((planes.shape[1], width), dtype=np.uint8)
    for index in range(width):
        elements[:, index] = planes[index]
    return torch.from_numpy(elements.reshape(-1))


def _compress(codec: str, data: bytes) -> bytes:
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=1).compress(data)
    if codec == "zlib":
        return zlib.compress(data, 1)
    if codec == "lz4":
        import lz4.frame

        return lz4.frame.compress(data)
    return data


def _decompress(codec: str, data: bytes, raw_bytes: int) -> bytes:
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_bytes)
    if codec == "zlib":
        return zlib.decompress(data)
    if codec == "lz4":
        import lz4.frame

        return lz4.frame.decompress(data)
    return data
