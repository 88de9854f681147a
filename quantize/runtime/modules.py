"""Runtime modules of quantized linears: what each can do lives on its class.

A handler (`quantize.runtime.handlers`) turns a scheme's stored tensors into one of these modules; from then on the
model, the serving runner and the benchmarks ask the module itself:
- `forward`: same call signature as `nn.Linear` (x [..., in] -> [..., out]), executing the packed weights with
  qpack's native kernels or torch's rather than dequantize-then-matmul;
- `decode_part()`: the tensors the fused native decode step reads as stored (None: the step can't run it);
- `decode_tensors()`: what one decode step reads per token (the memory-bound ceiling of `qpack bench decode`);
- `fuse(modules)`: one module computing the concatenated outputs of same-kind linears sharing an input (q/k/v,
  gate/up), whose storage the originals then share.
Plain `nn.Linear` (FP32 layers, unquantized models) gets the same three answers from the module-level
`decode_part`, `decode_bytes` and `fuse_linears`, the only places that tell it apart.

Kernels, by weight type and number of activation rows M:
- int8 (W8A16): qpack's native kernel for every M (register tiles for a few rows, a packed-panel GEMM for
  prompts), whose result for a row is defined exactly: the int16-rounded activations times the int8 weights,
  summed exactly, rounded to float once. So a row's result is the same whatever else shares its batch and
  whichever kernel or CPU computed it (a seeded request samples the same tokens alone or among 30: the fleet's
  regeneration after a worker's death relies on it; a prompt's KV equals what decode would compute). With
  `prefill_dtype` bf16, prompts keep dequantize + bf16 GEMM. Without the kernels,
  `aten._weight_int8pack_mm`, which on CPU is fast only with bf16 activations (fp32 is 10-50x slower), so
  activations are cast around it and the per-channel scale is applied in fp32 afterwards.
- int4 (W4A16): qpack's native kernel for every M (a row kernel that unpacks the nibbles in registers for a few
  rows, a GEMM over the packed weights for prompts), defined as exactly as int8 where it can be: each group's
  integer sum of the int16 activations times (q - zero point) is exact, the groups' `scale * sum` terms are added
  in order in double and rounded to float once (csrc/linear.h), so again a row's result does not depend on M, the
  kernel or the CPU. With `prefill_dtype` bf16, prompts dequantize natively and run a bf16 GEMM. Without the
  native kernels, `aten._weight_int4pack_mm_for_cpu` on CPU, `aten._weight_int4pack_mm` on CUDA, with our
  asymmetric zero point mapped exactly onto the kernels' `(q - 8) * scale + zero` form.
- `prefill_dtype` int8 (opt-in; `quantize.runtime.precision`): prompt-sized products of int8 and int4 weights
  round each activation row to int8 instead of int16, on the same native kernels and the same exact-sum
  definition (int4 then runs `vpmaddubsw`, half the multiplies); decode rows keep int16. Without the kernels the
  same rounding feeds a float32 GEMM of the dequantized weight.
- torch's weight-only kernels are matrix-vector loops whose CPU time grows linearly with M, so from
  `dense_min_rows` rows (prefill, evaluation) the weight is dequantized for that call into a reused buffer and
  a dense GEMM runs instead, in the module's `prefill_dtype` (float32 unless set): int8 crosses over at ~48
  rows, int4 at ~128 on the 2-core AVX2 reference machine.
- w8a8: dynamic per-token int8 activations. On CUDA `torch._int_mm` (int32 accumulation). On CPU
  `torch._int_mm` is a slow reference loop, so the int8 activations go through the int8 weight kernel as
  bf16 integers (exactly representable), which gives the same products with fp32 accumulation.

Each must match its handler's reference `dequantize` within stated tolerances (tests/quantize/test_modules.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quantize.formats import primitives as P
from quantize.formats.schemes import Int4, Scheme
from quantize.runtime.kernels import build
from quantize.runtime.kernels import ops as kernels
from quantize.runtime.precision import PREFILL_DTYPE_NAMES


class QuantLinear(nn.Module):
    """Base of runtime modules: same call signature as `nn.Linear` (x [..., in] -> [..., out])."""

    # Row-major [out_features, ...] tensors that a fused module's rows can stand in for (`fuse`).
    row_tensors: ClassVar[tuple[str, ...]] = ()
    # With the native kernels, below this many rows each row's output is bit-identical whatever the batch.
    batch_invariant_rows: ClassVar[int] = 48
    # The precision of prefill-sized GEMMs (`PREFILL_DTYPES`; `set_prefill_dtype`).
    prefill_dtype: torch.dtype = torch.float32

    def __init__(
        self, scheme: Scheme, in_features: int, out_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.bias: torch.Tensor | None
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.float32), persistent=False
        )

    def _native_rows(self, x2: torch.Tensor, native_prompts: bool) -> bool:
        """Whether the native kernel computes these rows in one call (every row's result is defined whatever M):
        not under autograd, and prompt-sized products only in float32 or int8 with `native_prompts` on (off: the
        dequantize + GEMM baseline the benchmarks compare against)."""
        if torch.is_grad_enabled() and x2.requires_grad:
            return False
        prompt = x2.shape[0] >= self.batch_invariant_rows
        return not prompt or (native_prompts and self.prefill_dtype in (torch.float32, torch.int8))

    def _activation_bits(self, x2: torch.Tensor) -> int:
        """What the native kernel rounds these activation rows to: int8 for a prompt-sized product with
        `prefill_dtype` int8, else int16 (the exact default)."""
        prompt = x2.shape[0] >= self.batch_invariant_rows
        return 8 if prompt and self.prefill_dtype == torch.int8 else 16

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.label()}"
        )

    def decode_part(self) -> kernels.Part | None:
        """(weight, scale, bias, zero_point) as the fused native decode step reads them; None where it can't."""
        return None

    def decode_tensors(self) -> list[torch.Tensor]:
        """The tensors a decode step reads from this module per token."""
        return list(self.buffers())

    def dense_weight(self) -> torch.Tensor | None:
        """The weight this module computes with, as FP32 [out, in] (None where its format can't say: a
        bitsandbytes layer); a cheaper copy of the model is quantized from it (speculative drafts)."""
        return None

    @classmethod
    def fuse(cls, modules: list[Any]) -> QuantLinear | None:
        """One module of this class for `modules` (all of this class, one input), or None where it can't."""
        return None


def decode_part(module: nn.Module) -> kernels.Part | None:
    """What the fused native decode step reads of any linear (quantized, or a plain FP32 `nn.Linear`)."""
    if isinstance(module, QuantLinear):
        return module.decode_part()
    if type(module) is nn.Linear and module.weight.dtype == torch.float32:
        return module.weight, None, module.bias, None
    return None


def decode_bytes(module: nn.Module) -> int:
    """Bytes a decode step reads from this module's own tensors per token (its children not included)."""
    if isinstance(module, QuantLinear):
        tensors = module.decode_tensors()
    elif isinstance(module, nn.Linear) or "norm" in type(module).__name__.lower():
        tensors = list(module.parameters(recurse=False))
    else:
        return 0
    return sum(t.numel() * t.element_size() for t in tensors)


def fuse_linears(modules: list[nn.Module]) -> nn.Module | None:
    """One module computing the concatenated outputs of linears that share an input (q/k/v, gate/up).

    Fewer, larger kernel calls per decode step; None when the modules are not all of one fusable kind.
    The originals are re-pointed at row slices of the fused storage (where the layout is row-major), so fusing
    costs no memory and the model's own modules still compute what they did.
    """
    linears: list[Any] = list(modules)  # nn.Linear or one QuantLinear class: in/out_features, row tensors
    kinds = {type(m) for m in linears}
    if len(kinds) != 1 or len(linears) < 2 or len({int(m.in_features) for m in linears}) != 1:
        return None
    kind = kinds.pop()
    fused: nn.Module | None
    rows: tuple[str, ...]
    if kind is nn.Linear:
        fused, rows = _fuse_float(linears), ("weight",)
    elif issubclass(kind, QuantLinear):
        fused, rows = kind.fuse(linears), kind.row_tensors
    else:
        return None
    if fused is not None:
        _share_rows(fused, linears, rows)
        if isinstance(fused, QuantLinear):
            fused.prefill_dtype = linears[0].prefill_dtype
    return fused


def _fuse_float(modules: list[nn.Linear]) -> nn.Linear:
    first = modules[0]
    bias = _cat_bias(modules)
    fused = nn.Linear(
        first.in_features,
        sum(m.out_features for m in modules),
        bias=bias is not None,
        device=first.weight.device,
    )
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in modules]), requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def _cat_bias(modules: list[Any]) -> torch.Tensor | None:
    biases: list[torch.Tensor | None] = [getattr(m, "bias", None) for m in modules]
    present = [b for b in biases if b is not None]
    if not present:
        return None
    return torch.cat(
        [
            b.detach().to(torch.float32)
            if b is not None
            else torch.zeros(int(m.out_features), device=present[0].device)
            for b, m in zip(biases, modules, strict=True)
        ]
    )


def _share_rows(fused: nn.Module, modules: list[Any], names: tuple[str, ...]) -> None:
    """Point each original module's row-major tensors at its rows of the fused module's tensors."""
    start = 0
    for module in modules:
        end = start + int(module.out_features)
        for name in names:
            mine, theirs = getattr(module, name, None), getattr(fused, name, None)
            if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
                continue
            rows = theirs.detach()[start:end]
            if rows.shape != mine.shape or rows.dtype != mine.dtype:
                continue
            if isinstance(mine, nn.Parameter):
                setattr(module, name, nn.Parameter(rows, requires_grad=False))
            else:
                module._buffers[name] = rows
        start = end


_SCRATCH = threading.local()

PREFILL_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in PREFILL_DTYPE_NAMES}


def parse_prefill_dtype(name: str) -> torch.dtype:
    """The dtype a prefill precision setting names; ValueError listing the choices otherwise."""
    if name not in PREFILL_DTYPES:
        raise ValueError(f"prefill dtype must be one of {', '.join(PREFILL_DTYPES)} (got {name!r})")
    return PREFILL_DTYPES[name]


def set_prefill_dtype(model: nn.Module, name: str) -> int:
    """Run the prefill-sized GEMMs of every quantized linear of `model` in `name` (see `PREFILL_DTYPES`); modules
    fused later inherit it. Returns how many modules were set."""
    dtype = parse_prefill_dtype(name)
    modules = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for module in modules:
        module.prefill_dtype = dtype
    return len(modules)


@contextmanager
def prefill_dtype_set(model: nn.Module, name: str) -> Iterator[None]:
    """For the duration, `model`'s quantized linears run prefill-sized products in `name` (`set_prefill_dtype`);
    then each gets its own setting back. `qpack quantize` measures the int8 prompt path's held-out KL with it."""
    modules = [m for m in model.modules() if isinstance(m, QuantLinear)]
    previous = [m.prefill_dtype for m in modules]
    set_prefill_dtype(model, name)
    try:
        yield
    finally:
        for module, dtype in zip(modules, previous, strict=True):
            module.prefill_dtype = dtype


def prefill_dtype_of(model: nn.Module) -> str:
    """The prefill precision `model`'s quantized linears run in ('float32' for a model without any); ValueError
    when they disagree."""
    found = {m.prefill_dtype for m in model.modules() if isinstance(m, QuantLinear)} or {torch.float32}
    if len(found) > 1:
        raise ValueError(f"quantized linears disagree on the prefill dtype: {sorted(map(str, found))}")
    dtype = found.pop()
    return next(name for name, value in PREFILL_DTYPES.items() if value == dtype)


def prompt_path(model: nn.Module) -> str:
    """Which kernels `model`'s prompt-sized products of quantized weights run on, in words: what an evaluation
    scored is what a server runs for the same artifact on the same machine."""
    kinds = {type(m) for m in model.modules() if isinstance(m, QuantLinear)}
    if not kinds:
        return "float32 GEMM (no quantized linears)"
    dtype = prefill_dtype_of(model)
    dense = (
        "int8 activations + dequantize + float32 GEMM" if dtype == "int8" else f"dequantize + {dtype} GEMM"
    )
    if not kernels.ready():
        return f"torch ops ({dense})"
    native = {Int8Linear: Int8Linear.native_prompts, Int4Linear: Int4Linear.native_prompts}
    if dtype not in ("float32", "int8") or not any(native.get(kind, False) for kind in kinds):
        return dense
    parts = []
    if native.get(Int8Linear) and Int8Linear in kinds:
        parts.append("int8 on AMX tiles" if kernels.amx() else f"int8 packed-panel GEMM ({kernels.isa()})")
    if native.get(Int4Linear) and Int4Linear in kinds:
        kernel = "vpmaddubsw nibble GEMM" if dtype == "int8" else "packed-nibble GEMM"
        parts.append(f"int4 {kernel} ({kernels.isa()})")
    activations = "int8 activations per token" if dtype == "int8" else "int16 activations"
    return f"native exact, {activations}: " + ", ".join(parts)


def numerics(model: nn.Module) -> dict[str, str | None]:
    """How `model` computes, recorded next to every result it produces (evaluation reports, the manifest, the
    server's `/v1/models`, benchmark JSON): the prefill dtype, the native kernel build in use (None: torch's
    ops) and the path prompt-sized products take."""
    return {
        "prefill_dtype": prefill_dtype_of(model),
        "native_kernels": kernels.isa(),
        "prompt_path": prompt_path(model),
    }


def _dense(x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x2 [M, K] @ weight [N, K]^T (weight float32, dequantized) -> [M, N] float32, multiplied in `dtype` (int8:
    each row of x2 rounded to int8 as the native kernels round it, then a float32 GEMM)."""
    if dtype == torch.int8:
        q, scale = P.round_rows(x2, P.INT8_MAX)
        return F.linear(q, weight) * scale
    if dtype == torch.float32 or x2.is_cuda:
        return F.linear(x2.to(torch.float32), weight)
    return F.linear(x2.to(dtype), weight.to(dtype)).to(torch.float32)


def _scratch(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A per-thread float32 buffer reused for the dense (prefill) path's dequantized weight: one allocation for
    the process instead of a fresh multi-MB tensor per layer per call. Only under inference mode (serving,
    evaluation): there the buffer is never saved for backward, and it stays an inference tensor."""
    if not torch.is_inference_mode_enabled():
        return torch.empty(int(shape[0]), int(shape[1]), dtype=torch.float32, device=device)
    numel = int(shape[0]) * int(shape[1])
    buffers: dict[torch.device, torch.Tensor] = getattr(_SCRATCH, "buffers", None) or {}
    _SCRATCH.buffers = buffers
    buffer = buffers.get(device)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=torch.float32, device=device)
        buffers[device] = buffer
    return buffer[:numel].view(int(shape[0]), int(shape[1]))


# ------------------------------------------------------------------------------------- floating point


class HalfLinear(QuantLinear):
    """16-bit weights. On a CPU without bf16 instructions a 16-bit GEMM is slow beyond a couple of rows, so
    decode rows (<= `half_max_rows`) multiply in 16 bit (half the bytes read) and larger batches upcast."""

    half_max_rows: ClassVar[int] = 2
    row_tensors = ("weight",)

    def __init__(self, scheme: Scheme, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(scheme, weight.shape[1], weight.shape[0], bias)
        self.weight: torch.Tensor
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.weight.dtype == torch.bfloat16 and kernels.takes(x2):
            y = kernels.linear(x2.to(torch.float32), self.weight)
        elif x.is_cuda or x2.shape[0] <= self.half_max_rows:
            y = F.linear(x2.to(self.weight.dtype), self.weight).to(torch.float32)
        else:
            y = F.linear(
                x2.to(torch.float32), _scratch(self.weight.shape, self.weight.device).copy_(self.weight)
            )
        return self._finish(y, x).reshape(*x.shape[:-1], self.out_features)

    def decode_part(self) -> kernels.Part | None:
        return (self.weight, None, self.bias, None) if self.weight.dtype == torch.bfloat16 else None

    def dense_weight(self) -> torch.Tensor | None:
        return self.weight.to(torch.float32)

    def decode_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    @classmethod
    def fuse(cls, modules: list[Any]) -> HalfLinear:
        return cls(modules[0].scheme, torch.cat([m.weight for m in modules]), _cat_bias(modules))


# ------------------------------------------------------------------------------------------------ int8

# aten._weight_int8pack_mm on CPU reads K in whole vectors with aligned loads and segfaults otherwise: on AVX2 K
# in vectors of 8 (K=172 crashed), on AVX-512 K in vectors of 16 with the weight 16-byte and the bf16 activations
# 32-byte aligned (K=40, a weight view at an 8-byte offset as safetensors lays tensors out, crashed; torch 2.13).
_INT8_K_MULTIPLE = 16
_KERNEL_ALIGNMENT = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous, in memory aligned for the CPU kernels' aligned vector loads (a copy only when it is not)."""
    t = t.contiguous()
    if t.device.type == "cpu" and t.data_ptr() % _KERNEL_ALIGNMENT:
        t = t.clone()
    return t


def _pad_k(qweight: torch.Tensor) -> torch.Tensor:
    pad = (-qweight.shape[1]) % _INT8_K_MULTIPLE
    return _aligned(F.pad(qweight, (0, pad)) if pad else qweight)


def _int8_kernel(x2: torch.Tensor, kernel_weight: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, K] times int8 weight [N, K'] (K' = K padded to a multiple of 16) -> [M, N] float32."""
    x16 = x2.to(torch.bfloat16)
    if kernel_weight.shape[1] != x16.shape[1]:
        x16 = F.pad(x16, (0, kernel_weight.shape[1] - x16.shape[1]))
    return torch.ops.aten._weight_int8pack_mm(_aligned(x16), kernel_weight, unit).to(torch.float32)


class Int8Linear(QuantLinear):
    dense_min_rows: ClassVar[int] = 48
    # Prompt-sized products on the native packed-panel GEMM (csrc/gemm.h) instead of dequantize + float32 GEMM.
    native_prompts: ClassVar[bool] = True
    row_tensors = ("qweight", "scale", "unit")

    def __init__(
        self, scheme: Scheme, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__(scheme, qweight.shape[1], qweight.shape[0], bias)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.unit: torch.Tensor
        self.register_buffer("qweight", _pad_k(qweight), persistent=False)  # [N, K padded to 16] int8
        self.register_buffer("scale", scale.to(torch.float32), persistent=False)  # [N]
        self.register_buffer("unit", torch.ones_like(scale, dtype=torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        qweight = self.qweight[:, : self.in_features]
        if x.is_cuda:
            y = _cuda_int8_mm(x2, qweight, self.scale)
        elif self._native(x2):
            y = kernels.linear(
                x2.to(torch.float32), self.qweight, self.scale, activation_bits=self._activation_bits(x2)
            )
        elif x2.shape[0] >= self.dense_min_rows:
            weight = P.dequantize_int8(qweight, self.scale, out=_scratch(qweight.shape, qweight.device))
            y = _dense(x2, weight, self.prefill_dtype)
        else:
            y = _int8_kernel(x2, self.qweight, self.unit) * self.scale
        return self._finish(y, x).reshape(*x.shape[:-1], self.out_features)

    def _native(self, x2: torch.Tensor) -> bool:
        """Whether the native kernel computes these rows (`_native_rows`; the kernels loaded, a CPU tensor)."""
        return (
            kernels.ready() and x2.device.type == "cpu" and self._native_rows(x2, Int8Linear.native_prompts)
        )

    def decode_part(self) -> kernels.Part | None:
        return self.qweight, self.scale, self.bias, None

    def decode_tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def dense_weight(self) -> torch.Tensor | None:
        return P.dequantize_int8(self.qweight[:, : self.in_features], self.scale)

    @classmethod
    def fuse(cls, modules: list[Any]) -> Int8Linear:
        qweight = torch.cat([m.qweight[:, : m.in_features] for m in modules])
        return cls(modules[0].scheme, qweight, torch.cat([m.scale for m in modules]), _cat_bias(modules))


_CUDA_INT8_NATIVE: dict[str, bool] = {}


def _cuda_int8_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CUDA W8A16: torch's native int8 weight kernel where this build has it, else dequantize in x's dtype."""
    if _CUDA_INT8_NATIVE.get("ok", True):
        try:
            y = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), qweight, torch.ones_like(scale, dtype=torch.bfloat16)
            )
            _CUDA_INT8_NATIVE["ok"] = True
            return y.to(torch.float32) * scale
        except (RuntimeError, NotImplementedError):
            _CUDA_INT8_NATIVE["ok"] = False
    return F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)


# ------------------------------------------------------------------------------------------------ int4


class Int4Linear(QuantLinear):
    dense_min_rows: ClassVar[int] = 128
    # Prompt-sized products on the native GEMM over the packed weights (csrc/gemm.h) instead of dequantize + GEMM.
    native_prompts: ClassVar[bool] = True
    row_tensors = ("qweight", "scale", "zero_point")

    def __init__(
        self,
        scheme: Int4,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        n, half_k = qweight.shape
        super().__init__(scheme, half_k * 2, n, bias)
        self.group_size = scheme.group_size
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.zero_point: torch.Tensor
        self.register_buffer("qweight", qweight, persistent=False)  # canonical: native kernels, dense path
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero_point", zero_point, persistent=False)
        self._torch_pack: tuple[torch.device, torch.Tensor, torch.Tensor] | None = None

    def _packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's int4 kernel layout of the weights (and its scale-and-zeros), built on first use for the
        device the weights are on: a second copy of the weights, which a CPU server with the native kernels never
        needs (on SmolLM2's mixed artifact 51 MB of 218)."""
        device = self.qweight.device
        if self._torch_pack is not None and self._torch_pack[0] == device:
            return self._torch_pack[1], self._torch_pack[2]
        q, scale, zero_point = P.unpack_int4(self.qweight), self.scale, self.zero_point  # q: [N, K] uint8
        # the kernels tile output channels by 16: pad with zero rows, slice them off after
        pad = (-q.shape[0]) % 16
        if pad:
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype, device=device)])
            scale = torch.cat([scale, torch.ones(pad, scale.shape[1], dtype=scale.dtype, device=device)])
            zero_point = torch.cat(
                [zero_point, torch.full((pad, zero_point.shape[1]), 8, dtype=zero_point.dtype, device=device)]
            )
        if device.type == "cuda":
            high_first = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack(
                high_first, 8 if self.in_features % 1024 == 0 else 2
            )
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scale_and_zeros = P.int4_cpu_scale_and_zeros(scale, zero_point, torch.bfloat16)
        self._torch_pack = (device, packed, scale_and_zeros)
        return packed, scale_and_zeros

    def native_ok(self) -> bool:
        """Whether the native kernels can run these weights (groups of a multiple of 32 inputs, at most 4096: the
        exact group sums then fit int32 lanes)."""
        return (
            self.group_size % 32 == 0
            and self.group_size <= build.INT4_MAX_GROUP
            and self.qweight.device.type == "cpu"
            and self.scale.dtype == torch.float16
            and self.zero_point.dtype == torch.uint8
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        native_ok = not x.is_cuda and kernels.ready() and self.native_ok()
        if x.is_cuda:
            packed, scale_and_zeros = self._packed()
            y = torch.ops.aten._weight_int4pack_mm(
                x2.to(torch.bfloat16), packed, self.group_size, scale_and_zeros
            )
        elif native_ok and self._native_rows(x2, Int4Linear.native_prompts):
            y = kernels.linear(
                x2.to(torch.float32),
                self.qweight,
                self.scale,
                None,
                self.zero_point,
                self._activation_bits(x2),
            )
        elif native_ok:
            weight = _scratch(torch.Size((self.qweight.shape[0], self.in_features)), self.qweight.device)
            kernels.dequantize_int4(self.qweight, self.scale, self.zero_point, weight)
            y = _dense(x2, weight, self.prefill_dtype)
        elif x2.shape[0] >= self.dense_min_rows or self._activation_bits(x2) == 8:
            weight = P.dequantize_int4(
                P.unpack_int4(self.qweight), self.scale, self.zero_point, self.group_size
            )
            y = _dense(x2, weight, self.prefill_dtype)
        else:
            packed, scale_and_zeros = self._packed()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), packed, self.group_size, scale_and_zeros
            )
        y = y[:, : self.out_features]
        return self._finish(y.to(torch.float32), x).reshape(*x.shape[:-1], self.out_features)

    def decode_part(self) -> kernels.Part | None:
        return (self.qweight, self.scale, self.bias, self.zero_point) if self.native_ok() else None

    def decode_tensors(self) -> list[torch.Tensor]:
        """The native kernels read the weights as stored; torch's kernels read their own packed copy."""
        if kernels.ready() and self.native_ok():
            return [self.qweight, self.scale, self.zero_point]
        return list(self._packed())

    def dense_weight(self) -> torch.Tensor | None:
        q = P.unpack_int4(self.qweight)
        return P.dequantize_int4(q, self.scale, self.zero_point, self.group_size)[:, : self.in_features]

    @classmethod
    def fuse(cls, modules: list[Any]) -> Int4Linear | None:
        if len({m.group_size for m in modules}) != 1:
            return None
        return cls(
            modules[0].scheme,
            torch.cat([m.qweight for m in modules]),
            torch.cat([m.scale for m in modules]),
            torch.cat([m.zero_point for m in modules]),
            _cat_bias(modules),
        )


# ------------------------------------------------------------------------------------------------ w8a8


class W8A8Linear(QuantLinear):
    def __init__(
        self,
        scheme: Scheme,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        smooth: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__(scheme, qweight.shape[1], qweight.shape[0], bias)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.inv_smooth: torch.Tensor | None
        self.unit: torch.Tensor
        self.register_buffer("qweight", _pad_k(qweight), persistent=False)
        self.register_buffer("scale", scale.to(torch.float32), persistent=False)
        self.register_buffer(
            "inv_smooth", None if smooth is None else (1.0 / smooth.to(torch.float32)), persistent=False
        )
        self.register_buffer("unit", torch.ones_like(scale, dtype=torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        xq, x_scale = P.quantize_per_token_int8(x2)  # [M, K] int8, [M, 1]
        qweight = self.qweight[:, : self.in_features]
        if x.is_cuda and xq.shape[0] > 16:
            acc = torch._int_mm(xq, qweight.t()).to(torch.float32)
        elif x.is_cuda:
            acc = F.linear(xq.to(torch.float32), qweight.to(torch.float32))
        else:
            acc = _int8_kernel(xq, self.qweight, self.unit)
        y = acc * x_scale * self.scale
        return self._finish(y, x).reshape(*x.shape[:-1], self.out_features)

    def decode_tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]


# ------------------------------------------------------------------------------------------ bitsandbytes


class BnbLinear(QuantLinear):
    """Wraps a bitsandbytes linear so it reports our scheme and keeps the caller's dtype."""

    def __init__(self, scheme: Scheme, inner: nn.Module, in_features: int, out_features: int) -> None:
        super().__init__(scheme, in_features, out_features, None)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float32)).to(x.dtype)

    def decode_tensors(self) -> list[torch.Tensor]:
        return [*self.inner.parameters(), *self.inner.buffers()]
