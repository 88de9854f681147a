"""The precisions a prefill-sized GEMM of an int8/int4 linear may run in, by name (importable without torch: every
config that offers the choice validates against these).

A prefill-sized batch dequantizes the weight for the call and runs one dense GEMM. float32 is the default on every
CPU, so a result never depends on which CPU computed it; bfloat16 (activations and dequantized weights, float32
accumulation in oneDNN) only when asked: on CPUs with AMX-BF16 or AVX512-BF16 it prefills faster at a measured KL
cost (benchmarks/dense_precision.py), elsewhere it runs emulated, slower, with the same numerics.
"""

from __future__ import annotations

PREFILL_DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")
DEFAULT_PREFILL_DTYPE = "float32"
