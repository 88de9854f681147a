"""Scheme handlers: how each scheme quantizes (RTN), dequantizes (the reference path) and executes.

Each scheme class has one registered `Handler`. The handler owns the scheme's *stored* form (a dict of named
tensors, which is what artifacts hold) and builds the *runtime* module from it. Runtime modules execute the
packed weights with torch's native kernels rather than dequantize-then-matmul:

- int8 (W8A16): `aten._weight_int8pack_mm`. On CPU it is fast only with bf16 activations (fp32 is 10-50x
  slower), so activations are cast around it; the per-channel scale is applied in fp32 afterwards so the
  scale itself is not rounded to bf16.
- int4 (W4A16): `aten._weight_int4pack_mm_for_cpu` on CPU, `aten._weight_int4pack_mm` on CUDA, with our
  asymmetric zero point mapped exactly onto the kernels' `(q - 8) * scale + zero` form.
- Both weight-only kernels are matrix-vector loops: on CPU their time grows linearly with the number of rows,
  so above `dense_min_rows` rows (prefill, evaluation) the weight is dequantized for that call and a dense
  fp32 GEMM is used instead. The thresholds are measured on this project's reference CPU (2 cores, AVX2):
  int8 crosses over at ~48 rows, int4 at ~128 (see benchmarks/kernels.py); decode always takes the kernel.
- w8a8: dynamic per-token int8 activations. On CUDA `torch._int_mm` (int32 accumulation). On CPU
  `torch._int_mm` is a slow reference loop, so the int8 activations go through the int8 weight kernel as
  bf16 integers (exactly representable), which gives the same products with fp32 accumulation.

The reference dequantize path (`Handler.dequantize`) is kept for tests and for sensitivity analysis; the
kernels must match it within stated tolerances (tests/quantize/test_modules.py).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quantize import native
from quantize import primitives as P
from quantize.errors import QpackError
from quantize.schemes import BF16, FP16, FP32, W8A8, BnbInt8, BnbNF4, Int4, Int8, Scheme

HANDLERS: dict[type[Scheme], Handler] = {}


def register_handler(scheme_cls: type[Scheme]) -> Any:
    def wrap(handler_cls: type[Handler]) -> type[Handler]:
        HANDLERS[scheme_cls] = handler_cls()
        return handler_cls

    return wrap


def handler_for(scheme: Scheme) -> Handler:
    try:
        return HANDLERS[type(scheme)]
    except KeyError:
        raise QpackError(f"no handler registered for scheme {scheme.type!r}") from None


class QuantLinear(nn.Module):
    """Base of runtime modules: same call signature as `nn.Linear` (x [..., in] -> [..., out])."""

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

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.label()}"
        )


class Handler(ABC):
    """How one scheme is stored, dequantized and executed."""

    tensor_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Round-to-nearest: weight [N, K] float -> stored tensors."""

    @abstractmethod
    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stored tensors -> weight [N, K] float32 (the reference path)."""

    @abstractmethod
    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        """Stored tensors -> runtime module on `device`."""

    def storage_bytes(self, tensors: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())


# ------------------------------------------------------------------------------------- floating point


class HalfLinear(QuantLinear):
    """16-bit weights. On a CPU without bf16 instructions a 16-bit GEMM is slow beyond a couple of rows, so
    decode rows (<= `half_max_rows`) multiply in 16 bit (half the bytes read) and larger batches upcast."""

    half_max_rows: ClassVar[int] = 2

    def __init__(self, scheme: Scheme, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(scheme, weight.shape[1], weight.shape[0], bias)
        self.weight: torch.Tensor
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.weight.dtype == torch.bfloat16 and native.takes(x2):
            y = native.linear(x2.to(torch.float32), self.weight)
        elif x.is_cuda or x2.shape[0] <= self.half_max_rows:
            y = F.linear(x2.to(self.weight.dtype), self.weight).to(torch.float32)
        else:
            y = F.linear(
                x2.to(torch.float32), _scratch(self.weight.shape, self.weight.device).copy_(self.weight)
            )
        return self._finish(y, x).reshape(*x.shape[:-1], self.out_features)


class _FloatHandler(Handler):
    dtype: ClassVar[torch.dtype] = torch.float32
    tensor_names = ("weight",)

    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": weight.detach().to(self.dtype).contiguous()}

    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return tensors["weight"].to(torch.float32)

    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        weight = tensors["weight"].to(device=device, dtype=self.dtype)
        if self.dtype == torch.float32:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias.to(device=device, dtype=torch.float32), requires_grad=False)
            return linear
        return HalfLinear(scheme, weight, None if bias is None else bias.to(device))


@register_handler(FP32)
class FP32Handler(_FloatHandler):
    dtype = torch.float32


@register_handler(BF16)
class BF16Handler(_FloatHandler):
    dtype = torch.bfloat16


@register_handler(FP16)
class FP16Handler(_FloatHandler):
    dtype = torch.float16


# ------------------------------------------------------------------------------------------------ int8

# aten._weight_int8pack_mm on CPU reads K in whole vectors with aligned loads and segfaults otherwise: on AVX2 K
# in vectors of 8 (K=172 crashed), on AVX-512 K in vectors of 16 with the weight 16-byte and the bf16 activations
# 32-byte aligned (K=40, a weight view at an 8-byte offset as safetensors lays tensors out, crashed; torch 2.13).
_INT8_K_MULTIPLE = 16
_KERNEL_ALIGNMENT = 64


_SCRATCH = threading.local()


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
    """bf16 x [M, K] times int8 weight [N, K'] (K' = K padded to a multiple of 8) -> [M, N] float32."""
    x16 = x2.to(torch.bfloat16)
    if kernel_weight.shape[1] != x16.shape[1]:
        x16 = F.pad(x16, (0, kernel_weight.shape[1] - x16.shape[1]))
    return torch.ops.aten._weight_int8pack_mm(_aligned(x16), kernel_weight, unit).to(torch.float32)


class Int8Linear(QuantLinear):
    dense_min_rows: ClassVar[int] = 48

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
        elif native.takes(x2):
            y = native.linear(x2.to(torch.float32), self.qweight, self.scale)
        elif x2.shape[0] >= self.dense_min_rows:
            weight = P.dequantize_int8(qweight, self.scale, out=_scratch(qweight.shape, qweight.device))
            y = F.linear(x2.to(torch.float32), weight)
        else:
            y = _int8_kernel(x2, self.qweight, self.unit) * self.scale
        return self._finish(y, x).reshape(*x.shape[:-1], self.out_features)


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


@register_handler(Int8)
class Int8Handler(Handler):
    tensor_names = ("qweight", "scale")

    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = P.int8_channel_scale(weight)
        return {"qweight": P.quantize_int8(weight, scale), "scale": scale}

    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return P.dequantize_int8(tensors["qweight"], tensors["scale"])

    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        return Int8Linear(
            scheme,
            tensors["qweight"].to(device),
            tensors["scale"].to(device),
            None if bias is None else bias.to(device),
        )


# ------------------------------------------------------------------------------------------------ int4


class Int4Linear(QuantLinear):
    dense_min_rows: ClassVar[int] = 128

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
        """Whether `native.linear` can run these weights (its int4 kernel reads groups of 32 inputs)."""
        return (
            self.group_size % 32 == 0
            and self.qweight.device.type == "cpu"
            and self.scale.dtype == torch.float16
            and self.zero_point.dtype == torch.uint8
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        native_ok = not x.is_cuda and native.ready() and self.native_ok()
        if x.is_cuda:
            packed, scale_and_zeros = self._packed()
            y = torch.ops.aten._weight_int4pack_mm(
                x2.to(torch.bfloat16), packed, self.group_size, scale_and_zeros
            )
        elif native_ok and native.takes(x2):
            y = native.linear(x2.to(torch.float32), self.qweight, self.scale, None, self.zero_point)
        elif native_ok:
            weight = _scratch(torch.Size((self.qweight.shape[0], self.in_features)), self.qweight.device)
            native.dequantize_int4(self.qweight, self.scale, self.zero_point, weight)
            y = F.linear(x2.to(torch.float32), weight)
        elif x2.shape[0] >= self.dense_min_rows:
            weight = P.dequantize_int4(
                P.unpack_int4(self.qweight), self.scale, self.zero_point, self.group_size
            )
            y = F.linear(x2.to(torch.float32), weight)
        else:
            packed, scale_and_zeros = self._packed()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), packed, self.group_size, scale_and_zeros
            )
        y = y[:, : self.out_features]
        return self._finish(y.to(torch.float32), x).reshape(*x.shape[:-1], self.out_features)


@register_handler(Int4)
class Int4Handler(Handler):
    tensor_names = ("qweight", "scale", "zero_point")

    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        assert isinstance(scheme, Int4)
        scale, zero_point = P.int4_group_params(weight, scheme.group_size)
        scale = scale.to(torch.float16).to(torch.float32)
        q = P.quantize_int4(weight, scale, zero_point, scheme.group_size)
        return self.pack(q, scale, zero_point)

    @staticmethod
    def pack(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "qweight": P.pack_int4(q),
            "scale": scale.to(torch.float16).contiguous(),
            "zero_point": zero_point.to(torch.uint8).contiguous(),
        }

    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        assert isinstance(scheme, Int4)
        q = P.unpack_int4(tensors["qweight"])
        return P.dequantize_int4(q, tensors["scale"], tensors["zero_point"], scheme.group_size)

    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        assert isinstance(scheme, Int4)
        return Int4Linear(
            scheme,
            tensors["qweight"].to(device),
            tensors["scale"].to(device),
            tensors["zero_point"].to(device),
            None if bias is None else bias.to(device),
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


@register_handler(W8A8)
class W8A8Handler(Handler):
    """Stored: int8 weight per channel, its scale, and (when it could not be folded into the previous
    norm or linear) the SmoothQuant factor `smooth` that the module divides activations by."""

    tensor_names = ("qweight", "scale", "smooth")

    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = P.int8_channel_scale(weight)
        return {"qweight": P.quantize_int8(weight, scale), "scale": scale}

    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = P.dequantize_int8(tensors["qweight"], tensors["scale"])
        if "smooth" in tensors:
            weight = weight / tensors["smooth"].to(torch.float32)[None, :]
        return weight

    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        smooth = tensors.get("smooth")
        return W8A8Linear(
            scheme,
            tensors["qweight"].to(device),
            tensors["scale"].to(device),
            None if smooth is None else smooth.to(device),
            None if bias is None else bias.to(device),
        )


# ------------------------------------------------------------------------------------------ bitsandbytes


def _bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError:
        raise QpackError(
            "schemes bnb-int8/bnb-nf4 need bitsandbytes; install the extra with `pip install qpack[bnb]`"
        ) from None
    return bitsandbytes


class BnbLinear(QuantLinear):
    """Wraps a bitsandbytes linear so it reports our scheme and keeps the caller's dtype."""

    def __init__(self, scheme: Scheme, inner: nn.Module, in_features: int, out_features: int) -> None:
        super().__init__(scheme, in_features, out_features, None)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float32)).to(x.dtype)


@register_handler(BnbInt8)
class BnbInt8Handler(Handler):
    tensor_names = ("qweight", "scb")

    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        functional = _bnb().functional
        qweight, scb, _ = functional.int8_vectorwise_quant(weight.detach().to(torch.float16))
        return {"qweight": qweight.contiguous(), "scb": scb.to(torch.float32)}

    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return tensors["qweight"].to(torch.float32) * (tensors["scb"].to(torch.float32)[:, None] / 127.0)

    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        assert isinstance(scheme, BnbInt8)
        bnb = _bnb()
        n, k = tensors["qweight"].shape
        inner = bnb.nn.Linear8bitLt(
            k, n, bias=bias is not None, has_fp16_weights=False, threshold=scheme.threshold
        )
        inner.weight = bnb.nn.Int8Params(
            tensors["qweight"].to(device),
            requires_grad=False,
            has_fp16_weights=False,
            SCB=tensors["scb"].to(device),
        )
        inner.weight.CB = inner.weight.data
        if bias is not None:
            inner.bias = nn.Parameter(bias.to(device=device, dtype=torch.float32), requires_grad=False)
        return BnbLinear(scheme, inner, k, n)


@register_handler(BnbNF4)
class BnbNF4Handler(Handler):
    tensor_names = ("qweight", "absmax", "code", "shape")

    def quantize(self, scheme: Scheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        assert isinstance(scheme, BnbNF4)
        functional = _bnb().functional
        packed, state = functional.quantize_4bit(
            weight.detach().to(torch.float32),
            blocksize=scheme.blocksize,
            quant_type="nf4",
            compress_statistics=False,
        )
        return {
            "qweight": packed.contiguous(),
            "absmax": state.absmax.to(torch.float32),
            "code": state.code.to(torch.float32),
            "shape": torch.tensor(list(weight.shape), dtype=torch.int64),
        }

    def _state(self, scheme: BnbNF4, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
        functional = _bnb().functional
        shape = torch.Size(tensors["shape"].tolist())
        return functional.QuantState(
            absmax=tensors["absmax"].to(device),
            shape=shape,
            code=tensors["code"].to(device),
            blocksize=scheme.blocksize,
            quant_type="nf4",
            dtype=torch.float32,
        )

    def dequantize(self, scheme: Scheme, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        assert isinstance(scheme, BnbNF4)
        functional = _bnb().functional
        state = self._state(scheme, tensors, tensors["qweight"].device)
        return functional.dequantize_4bit(tensors["qweight"], state).to(torch.float32)

    def build(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> nn.Module:
        assert isinstance(scheme, BnbNF4)
        bnb = _bnb()
        n, k = tensors["shape"].tolist()
        inner = bnb.nn.Linear4bit(
            k, n, bias=bias is not None, compute_dtype=torch.float32, quant_type="nf4", device=device
        )
        inner.weight = bnb.nn.Params4bit(
            tensors["qweight"].to(device),
            requires_grad=False,
            quant_state=self._state(scheme, tensors, device),
            blocksize=scheme.blocksize,
            quant_type="nf4",
            bnb_quantized=True,
            module=inner,
        )
        if bias is not None:
            inner.bias = nn.Parameter(bias.to(device=device, dtype=torch.float32), requires_grad=False)
        return BnbLinear(scheme, inner, k, n)


def _cat_bias(modules: list[nn.Module]) -> torch.Tensor | None:
    biases = [getattr(m, "bias", None) for m in modules]
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


def fuse_linears(modules: list[nn.Module]) -> nn.Module | None:
    """One module computing the concatenated outputs of linears that share an input (q/k/v, gate/up).

    Fewer, larger kernel calls per decode step; None when the modules are not all of one fusable kind.
    The originals are re-pointed at row slices of the fused storage (where the layout is row-major), so fusing
    costs no memory and the model's own modules still compute what they did.
    """
    kinds = {type(m) for m in modules}
    if len(kinds) != 1 or len(modules) < 2:
        return None
    first = modules[0]
    if len({int(m.in_features) for m in modules}) != 1:
        return None
    bias = _cat_bias(modules)
    fused: nn.Module
    if isinstance(first, nn.Linear):
        fused = nn.Linear(
            first.in_features,
            sum(m.out_features for m in modules),
            bias=bias is not None,
            device=first.weight.device,
        )
        fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in modules]), requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
    elif isinstance(first, Int8Linear):
        qweight = torch.cat([m.qweight[:, : m.in_features] for m in modules])  # type: ignore[index]
        fused = Int8Linear(first.scheme, qweight, torch.cat([m.scale for m in modules]), bias)  # type: ignore[misc]
    elif isinstance(first, Int4Linear):
        if len({m.group_size for m in modules}) != 1:  # type: ignore[attr-defined]
            return None
        assert isinstance(first.scheme, Int4)
        fused = Int4Linear(
            first.scheme,
            torch.cat([m.qweight for m in modules]),  # type: ignore[misc]
            torch.cat([m.scale for m in modules]),  # type: ignore[misc]
            torch.cat([m.zero_point for m in modules]),  # type: ignore[misc]
            bias,
        )
    elif isinstance(first, HalfLinear):
        fused = HalfLinear(first.scheme, torch.cat([m.weight for m in modules]), bias)  # type: ignore[misc]
    else:
        return None
    _share_rows(fused, modules)
    return fused


_ROW_TENSORS = ("weight", "qweight", "scale", "zero_point", "unit")


def _share_rows(fused: nn.Module, modules: list[nn.Module]) -> None:
    """Point each original module's row-major tensors at its rows of the fused module's tensors."""
    start = 0
    for module in modules:
        end = start + int(module.out_features)  # type: ignore[arg-type]
        for name in _ROW_TENSORS:
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
