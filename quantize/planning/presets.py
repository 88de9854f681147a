"""Presets: the named starting points of `qpack quantize`, each candidate schemes and a size budget.

A preset is data like everything else the planner reads: `PRESETS["int8"]` in Python, `--preset int8` on the
command line, or a `Preset` of one's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantize.formats.schemes import BF16, W8A8, Int4, Int8, Scheme


@dataclass(frozen=True)
class Preset:
    name: str
    candidates: tuple[Scheme, ...]
    """The schemes the planner chooses from for each decoder linear."""
    target_bits: float | None
    """The size budget in average bits per quantized weight (None: every layer takes the cheapest candidate)."""
    description: str


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "int8",
            (Int8(), BF16()),
            8.5,
            "int8 everywhere, the most sensitive layers kept in bf16 (8.5 bits)",
        ),
        Preset("int4", (Int4(64),), None, "int4 everywhere (int8 where the group size does not fit)"),
        Preset(
            "mixed",
            (Int4(128), Int4(64), Int8(), BF16()),
            4.75,
            "int4/int8/bf16 per layer from sensitivity (4.75 bits)",
        ),
        Preset("w8a8", (W8A8(),), None, "int8 weights and per-token int8 activations (SmoothQuant)"),
    )
}
