from __future__ import annotations

import pytest
import torch

from quantize.formats import primitives as P


def test_int8_reference_values() -> None:
    weight = torch.tensor([[1.0, -0.5, 0.25, 0.0], [-2.0, 1.0, 0.0, 0.01]])
    scale = P.int8_channel_scale(weight)
    torch.testing.assert_close(scale, torch.tensor([1 / 127, 2 / 127]))
    q = P.quantize_int8(weight, scale)
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, -64, 32, 0], [-127, 64, 0, 1]]  # -63.5 and 31.75 round half to even / nearest
    torch.testing.assert_close(P.dequantize_int8(q, scale), q.float() * scale[:, None])


def test_int8_round_trip_error_bound() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    scale = P.int8_channel_scale(weight)
    error = (P.dequantize_int8(P.quantize_int8(weight, scale), scale) - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()


def test_int4_reference_values() -> None:
    # one row, one group of 4: min -1, max 2 -> scale 3/15 = 0.2, zero point round(1/0.2) = 5
    weight = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    scale, zero_point = P.int4_group_params(weight, 4)
    torch.testing.assert_close(scale, torch.tensor([[0.2]]))
    assert zero_point.tolist() == [[5]] and zero_point.dtype == torch.uint8
    q = P.quantize_int4(weight, scale, zero_point, 4)
    assert q.tolist() == [[0, 5, 7, 15]]  # 0.5 / 0.2 = 2.5 -> 2 (half to even) + 5
    torch.testing.assert_close(
        P.dequantize_int4(q, scale, zero_point, 4), torch.tensor([[-1.0, 0.0, 0.4, 2.0]])
    )


def test_int4_group_round_trip_error_bound_and_zero_exact() -> None:
    torch.manual_seed(1)
    weight = torch.randn(32, 128)
    weight[:, 5] = 0.0
    for group in (32, 64, 128):
        scale, zero_point = P.int4_group_params(weight, group)
        dq = P.dequantize_int4(P.quantize_int4(weight, scale, zero_point, group), scale, zero_point, group)
        bound = scale.repeat_interleave(group, dim=1) / 2 + 1e-6
        assert ((dq - weight).abs() <= bound).all()
        assert (dq[:, 5] == 0).all()


def test_pack_unpack_int4_exact() -> None:
    q = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    packed = P.pack_int4(q)
    assert packed.shape == (7, 5) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    assert torch.equal(P.unpack_int4(packed), q)


def test_int4_kernel_zero_mapping_matches_dequantize() -> None:
    torch.manual_seed(2)
    weight = torch.randn(32, 64)
    scale, zero_point = P.int4_group_params(weight, 32)
    q = P.quantize_int4(weight, scale, zero_point, 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    x = torch.randn(3, 64)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, packed, 32, P.int4_cpu_scale_and_zeros(scale, zero_point, torch.float32)
    )
    reference = x @ P.dequantize_int4(q, scale, zero_point, 32).t()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4)


def test_per_token_int8() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25], [10.0, 0.0, -5.0]])
    q, scale = P.quantize_per_token_int8(x)
    torch.testing.assert_close(scale, torch.tensor([[1 / 127], [10 / 127]]))
    assert q.tolist() == [[64, -127, 32], [127, 0, -64]]


def test_smoothquant_scale_and_sqnr() -> None:
    s = P.smoothquant_scale(torch.tensor([4.0, 1.0]), torch.tensor([1.0, 4.0]), alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5]))
    signal = torch.ones(100)
    assert P.sqnr_db(signal, signal * 1.01) == pytest.approx(40.0, abs=0.01)
