"""Presets: the named starting points of `qpack quantize` (candidate schemes and a size budget), and the
algorithm each scheme type gets when none is asked for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    candidates: tuple[str, ...]
    target_bits: float | None
    description: str


PRESETS: dict[str, Preset] = {
    "int8": Preset(
        ("int8", "bf16"), 8.5, "int8 everywhere, the most sensitive layers kept in bf16 (8.5 bits)"
    ),
    "int4": Preset(
        ("int4",), None, "int4 everywhere at --group-size (int8 where the group size does not fit)"
    ),
    "mixed": Preset(
        ("int4-g128", "int4-g64", "int8", "bf16"),
        4.75,
        "int4/int8/bf16 per layer from sensitivity (4.75 bits)",
    ),
    "w8a8": Preset(("w8a8",), None, "int8 weights and per-token int8 activations (SmoothQuant)"),
}


DEFAULT_ALGORITHMS: dict[str, str] = {"int8": "gptq", "int4": "gptq", "w8a8": "smoothquant"}
