"""Every runtime module against the reference dequantize path, on both the kernel and the dense path."""

from __future__ import annotations

import pytest
import torch

from quantize.formats.schemes import BF16, FP16, W8A8, BnbInt8, BnbNF4, Int4, Int8, Scheme
from quantize.runtime.handlers import HANDLERS, handler_for
from quantize.runtime.modules import Int4Linear, Int8Linear, QuantLinear
from tests.numerics import gemm_error_bound, int16_rounding_bound

CASES: list[tuple[Scheme, float]] = [
    (Int8(), 2e-2),
    (Int4(32), 2e-2),
    (Int4(64), 2e-2),
    (BF16(), 5e-3),  # decode rows multiply in 16 bit: activations are rounded too
    (FP16(), 5e-3),
]


def _check(scheme: Scheme, n: int, k: int, rows: int, tolerance: float, bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(n, k) * 0.05
    b = torch.randn(n) if bias else None
    handler = handler_for(scheme)
    tensors = handler.quantize(scheme, weight)
    module = handler.build(scheme, tensors, b, torch.device("cpu"))
    x = torch.randn(rows, k)
    reference = torch.nn.functional.linear(x, handler.dequantize(scheme, tensors), b)
    out = module(x)
    assert out.shape == reference.shape and out.dtype == x.dtype
    relative = (out - reference).norm() / reference.norm()
    assert relative < tolerance, (scheme, rows, float(relative))
    out3 = module(x.reshape(1, rows, k))
    torch.testing.assert_close(out3.reshape(rows, n), out)


@pytest.mark.parametrize(
    ("scheme", "tolerance"), CASES, ids=lambda v: v.label() if isinstance(v, Scheme) else ""
)
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_kernel_matches_reference(scheme: Scheme, tolerance: float, rows: int, kernel_path: str) -> None:
    _check(scheme, 96, 128, rows, tolerance, bias=True)


def test_int4_odd_out_features_are_padded_for_the_kernel(kernel_path: str) -> None:
    _check(Int4(32), 172, 64, 3, 2e-2, bias=False)


@pytest.mark.parametrize("k", [172, 40, 120])  # the raw kernel segfaults on 172 (AVX2), 40 and 120 (AVX-512)
@pytest.mark.parametrize("scheme", [Int8(), W8A8()], ids=lambda s: s.label())
def test_int8_odd_in_features_are_padded_for_the_kernel(scheme: Scheme, k: int, kernel_path: str) -> None:
    _check(scheme, 64, k, 5, 2e-2, bias=False)


def _misaligned(t: torch.Tensor, offset_bytes: int = 8) -> torch.Tensor:
    """t's values in a view `offset_bytes` past a 64-byte boundary, as safetensors lays tensors out (8-aligned)."""
    nbytes = t.numel() * t.element_size()
    raw = torch.zeros(nbytes + 128, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 64 + offset_bytes
    view = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 64 == offset_bytes
    return view


@pytest.mark.parametrize("scheme", [Int8(), W8A8(), Int4(32)], ids=lambda s: s.label())
def test_kernels_take_misaligned_tensors(scheme: Scheme, kernel_path: str) -> None:
    """Loaded weights and activations need not sit on a vector boundary (torch's AVX-512 int8 kernel segfaulted
    on a weight 8 bytes past one, and on bf16 activations 16 bytes past one)."""
    torch.manual_seed(0)
    handler = handler_for(scheme)
    weight = torch.randn(64, 64) * 0.05
    tensors = {name: _misaligned(t) for name, t in handler.quantize(scheme, weight).items()}
    module = handler.build(scheme, tensors, None, torch.device("cpu"))
    reference = torch.nn.functional.linear(torch.ones(6, 64), handler.dequantize(scheme, tensors))
    for x in (_misaligned(torch.ones(6, 64)), _misaligned(torch.ones(6, 64).bfloat16(), 16)):
        out = module(x).float()
        assert ((out - reference).norm() / reference.norm()) < 2e-2


def test_dense_path_thresholds_are_exercised() -> None:
    assert Int8Linear.dense_min_rows <= 200 and Int4Linear.dense_min_rows <= 200


@pytest.mark.parametrize("scheme", [Int8(), Int4(32)], ids=lambda s: s.label())
@pytest.mark.parametrize("kernel_path", ["native"], indirect=True)
def test_a_rows_result_does_not_depend_on_its_batch_below_the_dense_path(
    scheme: Scheme, kernel_path: str
) -> None:
    """A seeded request must sample the same tokens alone or among others (fleet regeneration relies on it):
    every batch size that decode steps and short prefills use gives each row bit-identical outputs (with the
    native kernels; torch's int8/int4 paths make no such promise)."""
    from quantize.runtime.kernels import ops as kernels

    torch.manual_seed(0)
    handler = handler_for(scheme)
    module = handler.build(
        scheme, handler.quantize(scheme, torch.randn(200, 256) * 0.05), None, torch.device("cpu")
    )
    x = torch.randn(type(module).batch_invariant_rows - 1, 256)
    alone = torch.cat([module(row[None]) for row in x])
    for rows in (2, kernels.max_rows(), kernels.max_rows() + 5, x.shape[0]):
        batched = torch.cat([module(part) for part in x.split(rows)])
        assert torch.equal(batched, alone), rows


def test_quantization_error_floor(kernel_path: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    x = torch.randn(32, 256)
    reference = x @ weight.t()
    for scheme, min_sqnr in ((Int8(), 38.0), (Int4(64), 17.0), (BF16(), 45.0)):
        handler = handler_for(scheme)
        module = handler.build(scheme, handler.quantize(scheme, weight), None, torch.device("cpu"))
        from quantize.formats.primitives import sqnr_db

        assert sqnr_db(reference, module(x)) > min_sqnr, scheme


def test_w8a8_with_smoothing_matches_fake_quant(kernel_path: str) -> None:
    torch.manual_seed(3)
    weight = torch.randn(64, 128) * 0.05
    smooth = torch.rand(128) + 0.5
    scheme = W8A8()
    handler = handler_for(scheme)
    tensors = handler.quantize(scheme, weight * smooth[None, :])
    tensors["smooth"] = smooth
    module = handler.build(scheme, tensors, None, torch.device("cpu"))
    x = torch.randn(9, 128) * 3
    reference = x @ weight.t()
    out = module(x)
    assert ((out - reference).norm() / reference.norm()) < 2e-2
    torch.testing.assert_close(handler.dequantize(scheme, tensors), weight, atol=2e-3, rtol=0)


def test_every_scheme_has_a_handler() -> None:
    from quantize.formats.schemes import SCHEMES

    assert {cls.type for cls in HANDLERS} == set(SCHEMES)


@pytest.mark.parametrize("scheme", [BnbInt8(), BnbNF4()], ids=lambda s: s.label())
def test_bitsandbytes_schemes(scheme: Scheme) -> None:
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(4)
    weight = torch.randn(64, 128) * 0.05
    handler = handler_for(scheme)
    tensors = handler.quantize(scheme, weight)
    module = handler.build(scheme, tensors, None, torch.device("cpu"))
    assert isinstance(module, QuantLinear)
    x = torch.randn(5, 128)
    reference = x @ handler.dequantize(scheme, tensors).t()
    assert ((module(x) - reference).norm() / reference.norm()) < 2e-2
    assert ((reference - x @ weight.t()).norm() / reference.norm()) < 0.2


@pytest.mark.parametrize("scheme", [Int8(), Int4(32), BF16(), None], ids=lambda s: s.label() if s else "fp32")
def test_fused_projection_equals_separate_ones(scheme: Scheme | None, kernel_path: str) -> None:
    from quantize.runtime.modules import fuse_linears

    torch.manual_seed(5)
    modules = []
    for out_features in (64, 32, 32):
        weight, bias = torch.randn(out_features, 96) * 0.05, torch.randn(out_features)
        if scheme is None:
            linear = torch.nn.Linear(96, out_features)
            linear.weight.data, linear.bias.data = weight, bias
            modules.append(linear)
        else:
            handler = handler_for(scheme)
            modules.append(handler.build(scheme, handler.quantize(scheme, weight), bias, torch.device("cpu")))
    probe = torch.randn(7, 96)
    before = [m(probe) for m in modules]
    fused = fuse_linears(modules)
    assert fused is not None
    for rows in (1, 5, 300):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(fused(x), torch.cat([m(x) for m in modules], dim=-1), rtol=1e-5, atol=1e-5)
    for module, expected in zip(modules, before, strict=True):
        torch.testing.assert_close(module(probe), expected)
    if not isinstance(scheme, Int4):
        name = "qweight" if isinstance(scheme, Int8) else "weight"
        fused_storage = getattr(fused, name).untyped_storage().data_ptr()
        assert all(getattr(m, name).untyped_storage().data_ptr() == fused_storage for m in modules)
    assert fuse_linears([modules[0]]) is None


@pytest.mark.parametrize("scheme", [Int8(), Int4(64)], ids=lambda s: s.label())
def test_prefill_runs_in_float32_unless_set_whatever_the_cpu(scheme: Scheme, kernel_path: str) -> None:
    """One numeric path by default: a prefill-sized batch multiplies in float32 on every CPU (AMX and
    AVX512-BF16 included), or for int8 and int4 on the native kernels as their exact integer sums of the
    int16-rounded activation (each row's bits those of the row alone); bfloat16 only when set on the model, within bf16 rounding of the exact product, inherited by
    fused modules and reported by `prefill_dtype_of`."""
    from quantize.runtime.modules import fuse_linears, prefill_dtype_of, set_prefill_dtype

    torch.manual_seed(0)
    handler = handler_for(scheme)
    weight = torch.randn(96, 128) * 0.05
    tensors = handler.quantize(scheme, weight)
    model = torch.nn.Sequential(
        *(handler.build(scheme, tensors, None, torch.device("cpu")) for _ in range(2))
    )
    x = torch.randn(160, 128)  # prefill-sized: the dense path with or without the native kernels
    dequantized = handler.dequantize(scheme, tensors)
    exact = torch.nn.functional.linear(x.double(), dequantized.double())
    with torch.inference_mode():
        assert prefill_dtype_of(model) == "float32"
        float32 = model[0](x)
        bound = gemm_error_bound(x, dequantized, torch.float32)
        if kernel_path == "native":
            bound = int16_rounding_bound(x, dequantized)
            assert torch.equal(float32, torch.cat([model[0](x[i : i + 1]) for i in range(len(x))]))
        assert ((float32.double() - exact).abs() <= bound).all()
        assert set_prefill_dtype(model, "bfloat16") == 2 and prefill_dtype_of(model) == "bfloat16"
        bfloat16 = model[0](x)
        assert bfloat16.dtype == torch.float32 and not torch.equal(bfloat16, float32)
        assert ((bfloat16.double() - exact).abs() <= gemm_error_bound(x, dequantized, torch.bfloat16)).all()
        fused = fuse_linears(list(model))
        assert fused is not None and fused.prefill_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="prefill dtype must be one of float32, bfloat16, int8"):
        set_prefill_dtype(model, "float16")


def test_the_prompt_path_names_the_kernels_prompts_run_on(kernel_path: str) -> None:
    """Evaluation reports and /v1/models say which kernels scored prompts: the native exact GEMMs by weight type,
    or dequantize + GEMM in the prefill dtype, or torch's ops."""
    from quantize.runtime.modules import numerics, prompt_path, set_prefill_dtype

    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    layers = []
    for scheme in (Int8(), Int4(32)):
        handler = handler_for(scheme)
        layers.append(handler.build(scheme, handler.quantize(scheme, weight), None, torch.device("cpu")))
    model = torch.nn.Sequential(*layers)
    path = prompt_path(model)
    if kernel_path == "native":
        assert path.startswith("native exact, int16 activations: int8 ") and "int4 packed-nibble GEMM" in path
    else:
        assert path == "torch ops (dequantize + float32 GEMM)"
    set_prefill_dtype(model, "bfloat16")
    expected = "dequantize + bfloat16 GEMM"
    assert prompt_path(model) == (expected if kernel_path == "native" else f"torch ops ({expected})")
    assert numerics(model)["prompt_path"] == prompt_path(model)
    set_prefill_dtype(model, "int8")
    if kernel_path == "native":
        assert prompt_path(model).startswith("native exact, int8 activations per token: int8 ")
        assert "int4 vpmaddubsw nibble GEMM" in prompt_path(model)
    else:
        assert prompt_path(model) == "torch ops (int8 activations + dequantize + float32 GEMM)"
    assert numerics(model)["prefill_dtype"] == "int8"
    assert prompt_path(torch.nn.Sequential(torch.nn.Linear(4, 4))) == "float32 GEMM (no quantized linears)"
