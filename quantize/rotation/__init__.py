"""Rotations of the residual stream (QuaRot-style incoherence processing), absorbed into the weights offline.

A few large input channels stretch every quantization group's range; an orthogonal rotation of the residual
stream spreads them over all channels, and since RMSNorm commutes with an orthogonal map once its scale is folded
into the linears after it, the rotated FP32 model computes the same function. `hadamard` holds the matrices (pure
math), `absorb` folds and rotates a model's modules (surgery).
"""

ROTATIONS = ("none", "hadamard")  # `qpack quantize --rotate`
