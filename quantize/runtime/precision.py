"""The precisions a prefill-sized product of an int8/int4 linear may run in, by name (importable without torch: every
config that offers the choice validates against these).

float32 is the default on every CPU: the native kernels multiply each activation row rounded to int16 by the
integer weights and sum exactly, so a prompt's result never depends on which CPU computed it (without the kernels,
the weight is dequantized for the call and one float32 GEMM runs). The others trade a measured KL cost for speed,
only when asked:
- bfloat16: activations and dequantized weights in bf16, float32 accumulation in oneDNN; faster on CPUs with
  AMX-BF16 or AVX512-BF16 (benchmarks/dense_precision.py), elsewhere emulated, slower, with the same numerics.
- int8: each activation row rounded to int8 against its largest magnitude (dynamic, per token, |q| <= 127), the
  products still summed exactly; int4 weights then run `vpmaddubsw` (csrc/gemm_a8.h), half the multiplies of the
  int16 path. Its held-out KL is measured by `qpack quantize` (the manifest's `quality.prompt_int8`).
"""

from __future__ import annotations

PREFILL_DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "int8")
DEFAULT_PREFILL_DTYPE = "float32"
