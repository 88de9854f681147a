"""Scheme handlers: each scheme's stored form, its reference dequantization, and the runtime module built from it.

Each scheme class has one registered `Handler` (as torchao registers a handler per config). The handler owns
the scheme's *stored* form, a dict of named tensors, which is what artifacts hold and what GPTQ/AWQ produce;
`quantize` is round-to-nearest, `dequantize` the reference path that sensitivity analysis and the tests compare
the kernels against, and `build` turns stored tensors into the runtime module (`quantize.runtime.modules`) that
executes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from quantize.common.errors import QpackError
from quantize.formats import primitives as P
from quantize.formats.schemes import BF16, FP16, FP32, W8A8, BnbInt8, BnbNF4, Int4, Int8, Scheme
from quantize.runtime.modules import BnbLinear, HalfLinear, Int4Linear, Int8Linear, W8A8Linear

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


class Handler(ABC):
    """How one scheme is stored, dequantized and built into a runtime module."""

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


def _on(bias: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if bias is None else bias.to(device)


# ------------------------------------------------------------------------------------- floating point


class _FloatHandler(Handler):
    dtype: ClassVar[torch.dtype] = torch.float32

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
        return HalfLinear(scheme, weight, _on(bias, device))


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


@register_handler(Int8)
class Int8Handler(Handler):
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
            scheme, tensors["qweight"].to(device), tensors["scale"].to(device), _on(bias, device)
        )


# ------------------------------------------------------------------------------------------------ int4


@register_handler(Int4)
class Int4Handler(Handler):
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
            _on(bias, device),
        )


# ------------------------------------------------------------------------------------------------ w8a8


@register_handler(W8A8)
class W8A8Handler(Handler):
    """Stored: int8 weight per channel, its scale, and (when it could not be folded into the previous
    norm or linear) the SmoothQuant factor `smooth` that the module divides activations by."""

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
            _on(smooth, device),
            _on(bias, device),
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


@register_handler(BnbInt8)
class BnbInt8Handler(Handler):
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
