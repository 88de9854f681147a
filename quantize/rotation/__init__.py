"""Rotations of the residual stream (QuaRot-style incoherence processing), absorbed into the weights offline.

A few large input channels stretch every quantization group's range; an orthogonal rotation of the residual
stream spreads them over all channels, and since RMSNorm commutes with an orthogonal map once its scale is folded
into the linears after it, the rotated FP32 model computes the same function. `hadamard` holds the matrices (pure
math), `absorb` folds and rotates a model's modules (surgery).
"""

from collections.abc import Mapping

ROTATIONS = ("none", "hadamard")  # `qpack quantize --rotate`


def unabsorbed(record: object) -> str | None:
    """Why an artifact's recorded rotation (its manifest's `quantization.rotation`) is not fully in its weights,
    so that running or exporting the weights alone would compute another model; None when it is (or there is
    none). Every rotation this version writes is absorbed; an online transform, or a kind it does not know, is
    refused rather than silently dropped."""
    if not record:
        return None
    if not isinstance(record, Mapping):
        return f"its rotation record is {type(record).__name__}, not an object"
    kind = record.get("kind")
    if kind not in ROTATIONS:
        return f"its rotation kind {kind!r} is not one this qpack knows ({', '.join(ROTATIONS[1:])})"
    if record.get("online"):
        return f"its rotation has an online transform at run time ({record['online']}), not in the weights"
    return None
