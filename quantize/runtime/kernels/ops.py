"""Small-batch CPU kernels for the decode step, as Python ops: the whole stack of decoder layers for one new token
per sequence in one call (`decode_layers`), and the pieces it is made of as separate ops (weight-streaming
`linear` for int8, int4, bf16 and FP32 weights, paged `decode_attention`, `rms_norm`), plus the one-pass int4
dequantization the prefill path uses.

Decoding a few sequences is a matrix-vector product per linear layer, bound by reading the weights. torch's CPU
paths for it read far below the memory bandwidth on AVX2 machines: `_weight_int8pack_mm` ~5 GB/s (it
converts the activations to bf16 and is compute-bound), MKL's FP32 GEMV for the LM head ~6 GB/s, bf16 `mm`
slower still, against the ~11-17 GB/s that a plain `sum` reads on the same 2-core machine. `linear` streams
each weight row once for all rows of the activation and prefetches ahead of the stream (one core's own misses
read only ~6 GB/s here); int8 weights multiply the activations rounded to int16 per row (`vpmaddwd`, exact
integer sums), which needs a third of the instructions of widening each weight to float and is ~100x finer
than torch's bf16 rounding of the activations; bf16 and FP32 weights multiply FP32 activations.

`decode_layers` runs every decoder layer of a decode step (norm, q/k/v, RoPE, KV write, paged attention, o,
SiLU MLP, residuals) inside one OpenMP region of torch's own threads: each thread takes a byte-balanced share
of each projection's rows, applies RoPE and writes K/V for the heads it computed, and prefetches the start of
its next share while waiting at the barrier between dependent stages. Per layer, Python and ~20 small
tensor ops cost more than reading the weights at batch 1; fused, a SmolLM2-135M int8 step went from ~40-50 ms
to ~25 ms on the 2-core reference machine, ~14 ms of it the layers and ~10 ms the FP32 LM head.

Nothing builds the kernels behind a user's back: the serving engine calls `enable()` at start-up (a server pays
the minute of compiling once, before traffic; see `build.py`); until then, and where the compiler or AVX2 is
missing or the build fails, `ready()` is False and the quantized modules keep torch's ops. Calling an op while
the kernels are not loaded raises `KernelsUnavailable` with the reason. Results differ from torch's by float
summation order and, for int8/int4 weights, the int16 rounding of activations.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch

from quantize.runtime.kernels import build

_log = logging.getLogger("qpack.kernels")

# Activation rows routed here, per build: measured faster than torch's paths up to 16 rows with the AVX2 kernels
# (2-core AMD EPYC), up to 32 with the AVX-512 VNNI ones (2-core Xeon with AMX).
_MAX_ROWS = {"avx2": 16, "avx512": 32}

_lock = threading.Lock()
_module: ModuleType | None = None  # the kernels in use
_isa: str | None = None
_failed: str | None = None  # why `enable()` found none
_loaded: dict[str, ModuleType] = {}  # every build loaded in this process, by ISA


class KernelsUnavailable(RuntimeError):
    """An op was called while the native kernels are not loaded (check `ready()`, or call `enable()` first)."""


def enable() -> ModuleType | None:
    """Build (first time on this machine) and load the extension for this CPU (`build.target_isa()`); None,
    with the reason logged and kept in `unavailable_reason()`, where it can't be."""
    global _module, _failed, _isa
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("QPACK_NATIVE", "1") == "0":
            _failed = "disabled by QPACK_NATIVE=0"
        elif not build.cpu_supported():
            _failed = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2"
        else:
            target = build.target_isa()
            try:
                _module, _isa = _load(target), target
            except Exception as error:  # no compiler, no ninja, a build error: keep torch's kernels
                _failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if _failed is not None:
            _log.info("native small-batch kernels unavailable (%s); using torch's", _failed)
        return _module


def _load(target: str) -> ModuleType:
    if target not in _loaded:
        _loaded[target] = build.load(target)
    return _loaded[target]


def runnable_isas() -> tuple[str, ...]:
    """The builds this CPU can execute ('avx2', and 'avx512' where it has AVX-512 F/BW/VL and VNNI)."""
    if not build.cpu_supported():
        return ()
    return ("avx2", "avx512") if build.avx512_supported() else ("avx2",)


@contextmanager
def forced(target: str | None) -> Iterator[None]:
    """For the duration, every op and quantized module uses the kernels built for `target` ('avx2' or
    'avx512', built on first use), or none at all (None: torch's paths), whatever this CPU would pick; then
    the previous state returns. Tests name the path they check with it, so each path is tested on every machine
    that can execute it. ValueError for a build this CPU can't execute."""
    global _module, _isa
    if target is not None and target not in runnable_isas():
        raise ValueError(f"this CPU cannot run the {target} kernels (it runs: {', '.join(runnable_isas())})")
    with _lock:
        previous = (_module, _isa)
        _module, _isa = (None, None) if target is None else (_load(target), target)
    try:
        yield
    finally:
        with _lock:
            _module, _isa = previous


def ready() -> bool:
    """Whether kernels are loaded and in use (never builds anything itself)."""
    return _module is not None


def isa() -> str | None:
    """The instruction set the kernels in use were built for ('avx2' or 'avx512'); None when none are."""
    return _isa if _module is not None else None


def max_rows() -> int:
    """Activation rows the loaded kernels serve (`takes`) and the fused decode step runs (0 when not loaded)."""
    return _MAX_ROWS[_isa] if _module is not None and _isa is not None else 0


def amx() -> bool:
    """Whether int8 prompt-sized products run on AMX tiles: the AVX-512 build is in use, the CPU has AMX-INT8, the
    OS granted the tile state, and neither QPACK_NATIVE_AMX=0 nor `forced_amx(False)` switched it off. It changes
    the speed only: every int8 kernel computes the same exact integer sums."""
    return _module is not None and bool(_module.amx_enabled())


@contextmanager
def forced_amx(on: bool) -> Iterator[None]:
    """For the duration, int8 prompt products run on AMX tiles (`on`, where the CPU allows) or never; then the
    previous setting returns. Tests compare the two paths with it."""
    module = _kernels()
    previous = bool(module.amx_enabled())
    module.set_amx(on)
    try:
        yield
    finally:
        module.set_amx(previous)


def peak_rate(kind: str, iterations: int = 2_000_000) -> float:
    """Multiply-adds per second of one instruction at its issue rate on all torch threads: 'int16' (the int16-pair
    multiply-add every exact int8/int4 prompt GEMM is built on: `vpmaddwd`, or `vpdpwssd` in the AVX-512 build),
    'int8' (256-bit `vpmaddubsw`, the int4 GEMM over int8 activations, in both builds) or 'fp32' (FMA). The
    ceilings a GEMM's efficiency is stated against (benchmarks/prefill.py)."""
    return float(_kernels().peak_rate(kind, iterations))


def unavailable_reason() -> str | None:
    return _failed


def takes(x: torch.Tensor) -> bool:
    """Whether `linear` serves these activation rows: kernels loaded, CPU, at most `max_rows()` rows, no
    autograd (the kernels have no backward)."""
    return (
        _module is not None
        and x.device.type == "cpu"
        and x.shape[0] <= max_rows()
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def _kernels() -> ModuleType:
    """The loaded extension, or a clear error saying why there is none."""
    module = _module
    if module is None:
        reason = _failed or "enable() was not called"
        raise KernelsUnavailable(
            f"qpack's native kernels are not loaded ({reason}); call quantize.runtime.kernels.ops.enable() first, "
            "or take torch's path when ready() is False"
        )
    return module


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    activation_bits: int = 16,
) -> torch.Tensor:
    """x [M, K] float32 @ weight[:, :K].T (float32/int8/bfloat16) * scale[N] + bias[N] -> [M, N] float32; with
    `zero_point`, weight is int4 [N, K/2] uint8 (low nibble first) dequantized per group as (q - zero_point)
    * scale (both [N, K/g], scale float16, g a multiple of 32).
    int8 and int4 weights multiply each activation row rounded to `activation_bits` (16: |q| <= 32767, exact to
    ~1e-5 of the row's peak; 8: |q| <= 127, what `--prefill-dtype int8` runs prompts on), the products summed
    exactly (csrc/linear.h).
    Eager calls go straight to the extension (no dispatcher round trip: a decode step makes ~120 of them);
    inside torch.compile it is the opaque custom op `qpack::small_batch_linear`."""
    empty = x.new_empty(0)
    args = (
        x.contiguous(),
        weight,
        empty if scale is None else scale,
        empty if bias is None else bias.float(),
        empty if zero_point is None else zero_point,
    )
    if torch.compiler.is_compiling():
        return _small_batch_linear(*args, activation_bits)
    return _kernels().linear(*args, activation_bits)


@torch.library.custom_op("qpack::small_batch_linear", mutates_args=())
def _small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    zero_point: torch.Tensor,
    activation_bits: int,
) -> torch.Tensor:
    return _kernels().linear(x, weight, scale, bias, zero_point, activation_bits)


@_small_batch_linear.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    zero_point: torch.Tensor,
    activation_bits: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def dequantize_int4(
    qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """qweight [N, K/2] uint8 (low nibble first), scale [N, K/g] float16, zero_point [N, K/g] uint8 (g a multiple
    of 32) -> out [N, K] float32 = (q - zero_point) * scale, written in place."""
    _kernels().dequantize_int4(qweight, scale, zero_point, out)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its context, read in place from the paged KV pool.

    q [D, heads, d] float32; k_cache/v_cache [slots, kv_heads, d] float32 or bfloat16; slots [D, L] int64
    (row i: sequence i's context slots in order, padding beyond lengths[i] ignored); keys starts[i] ..
    lengths[i] - 1 are attended -> [D, heads * d] float32."""
    return _kernels().decode_attention(q.contiguous(), k_cache, v_cache, slots, starts, lengths, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm of x [T, H] float32 rows (torch's CPU `rms_norm` runs ~8 ops, ~50-90 us a call here)."""
    return _kernels().rms_norm(x.contiguous(), weight, eps)


def decode_layers(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layers: DecodeLayers,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    new_slots: torch.Tensor,
    ctx_slots: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Decoder layers (Llama/Qwen2: RMSNorm, q/k/v with RoPE, paged attention, o, SiLU gate/up MLP) for one new
    token per sequence, in a single call: one OpenMP region for all layers, the threads meeting at a barrier
    between dependent stages. Through the per-layer Python loop a batch-1 step spent more time in dispatch and
    ~20 small tensor ops per layer than in reading the weights.

    hidden [D, Hd] float32; cos/sin [D, d]; `layers` holds the weights; k_caches/v_caches: each layer's pool
    [slots, kv_heads, d] (float32 or bfloat16), written at new_slots [D]; ctx_slots [D, L], starts/lengths [D]
    as in `decode_attention`. Returns the hidden state after the last layer."""
    return _kernels().decode_layers(
        hidden,
        cos,
        sin,
        layers.norms,
        layers.linears,
        layers.parts,
        layers.eps,
        k_caches,
        v_caches,
        new_slots,
        ctx_slots,
        starts,
        lengths,
        num_heads,
        num_kv_heads,
        scale,
    )


# weight, scale, bias, zero_point: int8 [N, >= K] with scale [N]; bf16 or float32 [N, >= K]; int4 [N, K/2]
# uint8 with float16 scale and uint8 zero_point [N, K/g]. bias [N].
Part = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass
class DecodeLayers:
    """Consecutive decoder layers' tensors in the order `decode_layers` reads them. Each projection (q/k/v, o,
    gate/up, down) is one or more parts, each an int8 (per-row scale), int4 (per-group scale and zero point),
    bf16 or FP32 weight whose output rows follow the previous part's."""

    norms: list[torch.Tensor] = field(default_factory=list)
    linears: list[torch.Tensor] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)

    def add(
        self,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        eps: tuple[float, float],
        projections: list[list[Part]],
    ) -> None:
        assert len(projections) == 4, "q/k/v, o, gate/up, down"
        empty = torch.empty(0)
        self.norms += [input_norm.detach().contiguous(), post_norm.detach().contiguous()]
        self.eps += list(eps)
        for parts in projections:
            self.parts.append(len(parts))
            for weight, scale, bias, zero_point in parts:
                if scale is not None and zero_point is None:
                    scale = scale.to(torch.float32)
                self.linears += [
                    weight.detach(),
                    empty if scale is None else scale.detach().contiguous(),
                    empty if bias is None else bias.detach().to(torch.float32).contiguous(),
                    empty if zero_point is None else zero_point.detach().contiguous(),
                ]
