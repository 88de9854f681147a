"""The native small-batch kernels against torch references: every weight type, odd row counts, K tails, padded
rows, scale and bias; and the quantized modules routing decode-sized batches to them.

Each kernel test names the build it checks (`isa`: avx2, avx512) and forces it, whatever this CPU would pick, so
an AVX-512 machine tests both builds in one run; a build the CPU cannot execute is skipped with that reason (the
AVX-512 sources are then still compiled, by `test_the_avx512_sources_compile_on_any_machine`)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterable, Iterator

import pytest
import torch
import torch.nn.functional as F

from quantize.formats import primitives as P
from quantize.formats.schemes import BF16, Int4, Int8
from quantize.runtime.handlers import Int4Handler
from quantize.runtime.kernels import build
from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import PREFILL_DTYPES, HalfLinear, Int4Linear, Int8Linear
from tests.numerics import gemm_error_bound, int16_rounding_bound

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="needs a C++ compiler and an AVX2 CPU",
)


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel build a test runs on, forced for its duration."""
    if request.param not in kernels.runnable_isas():
        pytest.skip(f"this CPU cannot execute the {request.param} build")
    with kernels.forced(request.param):
        yield request.param


def test_this_machines_build_loads() -> None:
    assert kernels.enable() is not None, kernels.unavailable_reason()
    assert kernels.isa() == build.target_isa()


def test_a_forced_build_is_the_one_in_use_until_the_block_ends() -> None:
    kernels.enable()
    default = kernels.isa()
    with kernels.forced("avx2"):
        assert (kernels.isa(), kernels.max_rows()) == ("avx2", 16)
        with kernels.forced(None):
            assert not kernels.ready() and kernels.max_rows() == 0
            assert not kernels.takes(torch.zeros(1, 8))
        assert kernels.isa() == "avx2"
    assert kernels.isa() == default
    if "avx512" not in kernels.runnable_isas():
        with pytest.raises(ValueError, match="cannot run the avx512"), kernels.forced("avx512"):
            pass


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 27, 32])
@pytest.mark.parametrize("k", [20, 64, 72, 576])  # K tails past the 8-, 16- and 32-wide vector loops
def test_every_weight_type_matches_torch(rows: int, k: int, isa: str) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + k)
    n = 37
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    scale = torch.rand(n, generator=generator) / 100 + 1e-3
    qweight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    padded = F.pad(qweight, (0, 12))  # row stride beyond K, as Int8Linear stores it

    close = {"rtol": 1e-4, "atol": 1e-4}  # float sums in another order
    torch.testing.assert_close(kernels.linear(x, weight, None, bias), F.linear(x, weight, bias), **close)
    exact = F.linear(x.double(), qweight.double()) * scale.double()
    got = kernels.linear(x, padded, scale).double()
    assert ((got - exact).abs() <= int16_rounding_bound(x, qweight.double() * scale.double()[:, None])).all()
    bf16_x = F.linear(x.to(torch.bfloat16).double(), qweight.double()) * scale.double()
    if k >= 64:  # closer to the FP32 result than torch's _weight_int8pack_mm, which rounds x to bf16
        assert (got - exact).abs().mean() * 20 < (bf16_x - exact).abs().mean()
    half = weight.to(torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, half), F.linear(x, half.float()), **close)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_a_rows_result_does_not_depend_on_the_other_rows(kind: str, isa: str) -> None:
    """Batch invariance: each row of an M-row call equals that row computed alone, bit for bit, for every M up
    to the kernels' rows (serve's --batch-invariant and the fleet's seeded regeneration rely on it)."""
    generator = torch.Generator().manual_seed(7)
    k, n = 584, 45  # K past every vector width and unroll
    weight = torch.randn(n, k, generator=generator)
    args: tuple[torch.Tensor | None, ...]
    if kind == "int4":
        scheme = Int4(group_size=32)
        tensors = Int4Handler().quantize(scheme, weight[:, :576])
        k, args = 576, (tensors["qweight"], tensors["scale"], None, tensors["zero_point"])
    elif kind == "int8":
        scale = weight.abs().amax(1) / 127
        args = (
            torch.round(weight / scale[:, None]).to(torch.int8),
            scale,
            torch.randn(n, generator=generator),
        )
    else:
        args = (weight.to(getattr(torch, kind)), None, torch.randn(n, generator=generator))
    x = torch.randn(kernels.max_rows(), k, generator=generator)
    alone = torch.cat([kernels.linear(x[i : i + 1], *args) for i in range(x.shape[0])])
    for rows in range(2, x.shape[0] + 1):
        assert torch.equal(kernels.linear(x[:rows], *args), alone[:rows]), rows


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prompt_sized_products_equal_each_row_alone_across_tiles_and_threads(kind: str, isa: str) -> None:
    """From 8 rows the int8 kernel runs register tiles (csrc/tiles.h) instead of its decode loop, from 48 rows a
    packed-panel GEMM; int4 runs its row kernel, then from 48 rows its GEMM over the packed weights: every row
    of every M from 1 to 300, on 1 and 2 threads, must still equal that row computed alone, bit for bit, so a
    prompt and its decode compute the same bits. K crosses the int8 kernels' 2048-input block and leaves a
    tail, and holds 33 int4 groups (eight at a time, then one); N leaves a partial tile and panel of weight
    rows."""
    generator = torch.Generator().manual_seed(11)
    n = 23
    args: tuple[torch.Tensor | None, ...]
    if kind == "int4":
        k = 2112
        tensors = Int4Handler().quantize(Int4(group_size=64), torch.randn(n, k, generator=generator))
        args = (tensors["qweight"], tensors["scale"], None, tensors["zero_point"])
    else:
        k = 2090
        args = (
            torch.randint(-127, 128, (n, k + 6), generator=generator, dtype=torch.int8),
            torch.rand(n, generator=generator) / 100,
            torch.randn(n, generator=generator),
        )
    _each_m_equals_each_row_alone(torch.randn(300, k, generator=generator), args, range(1, 301))


def _each_m_equals_each_row_alone(x: torch.Tensor, args: tuple, counts: Iterable[int]) -> None:
    """kernels.linear(x[:M], *args) equals each of its rows computed alone, bit for bit, for every M in `counts`,
    on 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernels.linear(x[i : i + 1], *args) for i in range(x.shape[0])])
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in counts:
                assert torch.equal(kernels.linear(x[:rows], *args), alone[:rows]), (rows, count)
    finally:
        torch.set_num_threads(threads)


def _rounded_rows(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row rounded to integers |q| <= top (half to even) against its largest magnitude, computed here
    independently of the kernels: q int64 [M, K], the row scales peak / top [M]."""
    peak = x.abs().amax(1)
    inverse = torch.where(peak > 0, torch.tensor(float(top)) / peak, torch.zeros_like(peak))
    return torch.round(x * inverse[:, None]).to(torch.int64), peak / float(top)


def _exact_int8_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, top: int = 32767
) -> torch.Tensor:
    """What the int8 kernels define, computed independently: each row rounded to int16 (or int8: top 127) against
    its largest magnitude, the integer products summed exactly (int64 matmul), the sum rounded to float once,
    then times the row's and the weight row's scales."""
    q, row_scale = _rounded_rows(x, top)
    exact = q @ qweight[:, : x.shape[1]].to(torch.int64).T
    return exact.to(torch.float32) * (row_scale[:, None] * scale[None, :])


@pytest.mark.parametrize("k", [2090, 2091])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40, 300])
def test_int8_products_are_the_exact_integer_sum_rounded_once(rows: int, k: int, isa: str) -> None:
    """The int8 kernels' result is defined, not merely close: the exact integer sum of the int16 activation
    times the int8 weight, rounded to float once. Checked bit for bit against an int64 matmul, for the decode
    rows, the register tiles and the prompt GEMM, across the 2048- and 512-input blocks and a K tail (an odd K
    keeps the tiles); large activations and extreme weights (-128, 127) fill the int32 lanes as full as they
    get."""
    generator = torch.Generator().manual_seed(rows)
    n = 37
    x = torch.randn(rows, k, generator=generator)
    x[:, :1024] = x[:, :1024].sign() * 50  # every activation of the first half at the row's peak
    qweight = torch.randint(-128, 128, (n, k + 6), generator=generator, dtype=torch.int8)
    qweight[0, :] = -128
    scale = torch.rand(n, generator=generator) / 100 + 1e-4
    assert torch.equal(kernels.linear(x, qweight, scale), _exact_int8_reference(x, qweight, scale))


def _exact_int4_reference(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], group: int, top: int = 32767
) -> torch.Tensor:
    """What the int4 kernels define, computed independently: each row rounded to int16 (or int8) as for int8; per
    group the exact integer sum of the activations times (q - zero point) (int64 matmul); the groups' scale * sum
    terms added in order in float64 (each term exact there); rounded to float once, then times the row's scale."""
    q = P.unpack_int4(tensors["qweight"]).to(torch.int64)
    zero, scale = tensors["zero_point"].to(torch.int64), tensors["scale"].to(torch.float64)
    a, row_scale = _rounded_rows(x, top)
    total = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    for g in range(x.shape[1] // group):
        inputs = slice(g * group, (g + 1) * group)
        exact = a[:, inputs] @ (q[:, inputs] - zero[:, g : g + 1]).T
        total = total + scale[:, g][None, :] * exact.to(torch.float64)
    return total.to(torch.float32) * row_scale[:, None]


@pytest.mark.parametrize("group", [32, 64, 128, 96])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 47, 48, 131])
def test_int4_products_are_exact_group_sums_added_in_order(rows: int, group: int, isa: str) -> None:
    """The int4 kernels' result is defined, not merely close (csrc/linear.h): exact integer sums per group, the
    groups' terms added in order in double, rounded once. Checked bit for bit against an int64 matmul and a
    float64 sum, for the row kernel (below 48 rows) and the packed-int4 GEMM (from 48), for the group sizes the
    row kernel unrolls and one it loops over, with a tail of groups past the eight folded at a time; the
    first inputs at the row's peak and weights at 0 and 15 fill the int32 lanes."""
    generator = torch.Generator().manual_seed(rows * 1000 + group)
    n, k = 29, group * 11
    weight = torch.randn(n, k, generator=generator)
    weight[0, ::2], weight[0, 1::2] = -1.0, 1.0  # nibbles 0 and 15 in every group of row 0
    tensors = Int4Handler().quantize(Int4(group_size=group), weight)
    x = torch.randn(rows, k, generator=generator)
    x[:, :group] = x[:, :group].sign() * 40
    got = kernels.linear(x, tensors["qweight"], tensors["scale"], None, tensors["zero_point"])
    assert torch.equal(got, _exact_int4_reference(x, tensors, group))


@pytest.mark.parametrize("rows", [1, 48])
def test_the_largest_int4_group_sums_exactly_at_its_extremes(rows: int, isa: str) -> None:
    """A group of build.INT4_MAX_GROUP inputs, every activation at its peak (32767) and every weight 15 above its
    zero point: the group sum 32767 * 15 * 4096 is the largest there is, and must not wrap its int32 lanes in the
    row kernel or the GEMM; a larger group is refused with the limit named."""
    group, n = build.INT4_MAX_GROUP, 3
    tensors = {
        "qweight": torch.full((n, group), 0xFF, dtype=torch.uint8),
        "scale": torch.ones(n, 2, dtype=torch.float16),
        "zero_point": torch.zeros(n, 2, dtype=torch.uint8),
    }
    tensors["zero_point"][1, 1] = 15  # row 1's second group: all zero, its first at the extreme
    x = torch.ones(rows, 2 * group)
    got = kernels.linear(x, tensors["qweight"], tensors["scale"], None, tensors["zero_point"])
    assert torch.equal(got, _exact_int4_reference(x, tensors, group))
    assert got[0, 0].item() == 2 * 32767 * 15 * group / 32767
    with pytest.raises(RuntimeError, match=f"at most {group}"):
        kernels.linear(
            x,
            tensors["qweight"],
            tensors["scale"][:, :1].contiguous(),
            None,
            tensors["zero_point"][:, :1].contiguous(),
        )


@pytest.mark.parametrize("group", [32, 64, 128, 96])
@pytest.mark.parametrize("rows", [1, 13, 47, 48, 131])
def test_int8_activations_match_quantize_then_integer_matmul_exactly(rows: int, group: int, isa: str) -> None:
    """`--prefill-dtype int8` (activation_bits 8): each activation row rounded to int8 against its peak, then the
    same exact definitions as the int16 path. Bit for bit against rounding here and an int64 matmul: int4 on its
    row kernel (below 48 rows) and on the `vpmaddubsw` GEMM over raw nibbles (from 48), where the zero point is
    subtracted as zero * sum(q) per group; nibbles 0 and 15 and activations at the peak (|q| = 127) fill the int16
    pair sums as full as they get; int8 weights (-127 .. 127) on every kernel."""
    generator = torch.Generator().manual_seed(rows * 1000 + group)
    n, k = 29, group * 11
    weight = torch.randn(n, k, generator=generator)
    weight[0, ::2], weight[0, 1::2] = -1.0, 1.0
    tensors = Int4Handler().quantize(Int4(group_size=group), weight)
    x = torch.randn(rows, k, generator=generator)
    x[:, :group] = x[:, :group].sign() * 40
    got = kernels.linear(x, tensors["qweight"], tensors["scale"], None, tensors["zero_point"], 8)
    assert torch.equal(got, _exact_int4_reference(x, tensors, group, top=127))
    qweight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, generator=generator) / 100 + 1e-4
    got = kernels.linear(x, qweight, scale, activation_bits=8)
    assert torch.equal(got, _exact_int8_reference(x, qweight, scale, top=127))
    with pytest.raises(RuntimeError, match="activation_bits: 16 or 8"):
        kernels.linear(x, qweight, scale, activation_bits=4)


def test_int8_activation_prompts_equal_each_row_alone_across_tiles_and_threads(isa: str) -> None:
    """With int8 activations an int4 row is the same bits whatever M, tile or thread count, row kernel (below 48
    rows) or `vpmaddubsw` GEMM (from 48; 4-row tiles and 24-row panels, N leaving partial ones): every M from 1 to
    300 on 1 and 2 threads against each row alone."""
    generator = torch.Generator().manual_seed(12)
    n, k = 53, 2112
    tensors = Int4Handler().quantize(Int4(group_size=64), torch.randn(n, k, generator=generator))
    args = (
        tensors["qweight"],
        tensors["scale"],
        torch.randn(n, generator=generator),
        tensors["zero_point"],
        8,
    )
    counts = (*range(1, 60), *range(60, 301, 7), 300)
    _each_m_equals_each_row_alone(torch.randn(300, k, generator=generator), args, counts)


def test_both_builds_compute_the_same_int8_bits() -> None:
    """An exact sum has no order, so the AVX2 and AVX-512 builds (8 or 16 lanes, other tiles) agree to the bit:
    a server's int8 layers answer the same on every CPU kind."""
    if "avx512" not in kernels.runnable_isas():
        pytest.skip("this CPU runs only the avx2 build")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(70, 1536, generator=generator)
    qweight = torch.randint(-128, 128, (96, 1536), generator=generator, dtype=torch.int8)
    scale = torch.rand(96, generator=generator) / 100
    bias = torch.randn(96, generator=generator)
    outputs = []
    for isa in ("avx2", "avx512"):
        with kernels.forced(isa):
            outputs.append(torch.cat([kernels.linear(x[:m], qweight, scale, bias) for m in (1, 5, 16, 70)]))
    assert torch.equal(*outputs)


def test_amx_tiles_compute_the_same_int8_bits() -> None:
    """Where the CPU has AMX-INT8, prompt-sized int8 products run on its tiles, each int16 activation split into a
    signed high and an unsigned low byte: the exact sum again, so the same bits as the AVX-512 kernels and the
    int64 reference, for row counts off the 16-row tiles, K off the 64-input steps, N off the 32-row panels."""
    kernels.enable()
    with kernels.forced("avx512") if "avx512" in kernels.runnable_isas() else contextlib.nullcontext():
        with kernels.forced_amx(True):
            if not kernels.amx():
                pytest.skip("this CPU (or its OS) offers no AMX-INT8: the AMX GEMM never runs here")
        generator = torch.Generator().manual_seed(5)
        for rows, k, n in ((48, 576, 960), (130, 2090, 37), (300, 72, 33)):
            x = torch.randn(rows, k, generator=generator)
            x[:, : k // 2] = x[:, : k // 2].sign() * 50
            qweight = torch.randint(-128, 128, (n, k + 6), generator=generator, dtype=torch.int8)
            scale = torch.rand(n, generator=generator) / 100
            bias = torch.randn(n, generator=generator)
            with kernels.forced_amx(True):
                tiles = kernels.linear(x, qweight, scale, bias)
                assert torch.equal(
                    kernels.linear(x, qweight, scale), _exact_int8_reference(x, qweight, scale)
                )
            with kernels.forced_amx(False):
                assert torch.equal(tiles, kernels.linear(x, qweight, scale, bias)), (rows, k, n)


def _int4_case(
    rows: int, group_size: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """x [rows, 192], int4 stored tensors of a [40, 192] weight, its dequantized form (float32), a bias."""
    generator = torch.Generator().manual_seed(rows * 100 + group_size)
    n, k = 40, 192
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator) * 3
    tensors = Int4Handler().quantize(Int4(group_size=group_size), weight)
    q = P.unpack_int4(tensors["qweight"])
    dequantized = P.dequantize_int4(q, tensors["scale"], tensors["zero_point"], group_size)
    return x, tensors, dequantized, torch.randn(n, generator=generator)


@pytest.mark.parametrize("rows", [1, 3, 9, 32])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_weights_match_their_dequantized_form(rows: int, group_size: int, isa: str) -> None:
    x, tensors, dequantized, bias = _int4_case(rows, group_size)
    exact = F.linear(x.double(), dequantized.double(), bias.double())
    got = kernels.linear(x, tensors["qweight"], tensors["scale"], bias, tensors["zero_point"]).double()
    assert ((got - exact).abs() <= int16_rounding_bound(x, dequantized)).all()
    assert (got - exact).abs().max() < 0.01 * exact.abs().mean()
    module = Int4Linear(
        Int4(group_size=group_size), tensors["qweight"], tensors["scale"], tensors["zero_point"], bias
    )
    with torch.inference_mode():
        if rows <= kernels.max_rows():
            torch.testing.assert_close(module(x).double(), got, rtol=1e-6, atol=1e-5)  # routed to the kernel


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int8_prefill_rounds_prompt_activations_to_int8_and_decode_rows_to_int16(kind: str, isa: str) -> None:
    """A module with prefill dtype int8 runs prompt-sized products (>= 48 rows) on the kernels with int8
    activations and decode-sized ones with int16, bit for bit as the kernels define them; without the kernels
    its prompts round the activations the same way and run a float32 GEMM of the dequantized weight, within that
    GEMM's rounding of the same exact product."""
    x, tensors, dequantized, bias = _int4_case(150, 64)
    module: Int4Linear | Int8Linear
    if kind == "int4":
        module = Int4Linear(
            Int4(group_size=64), tensors["qweight"], tensors["scale"], tensors["zero_point"], bias
        )
        args: tuple[torch.Tensor | None, ...] = (
            tensors["qweight"],
            tensors["scale"],
            None,
            tensors["zero_point"],
        )
    else:
        scale = dequantized.abs().amax(1) / 127
        qweight = torch.round(dequantized / scale[:, None]).to(torch.int8)
        module, args = Int8Linear(Int8(), qweight, scale, bias), (qweight, scale)
        dequantized = qweight.float() * scale[:, None]
    module.prefill_dtype = PREFILL_DTYPES["int8"]
    with torch.inference_mode():  # the module adds its bias after the kernel
        assert torch.equal(module(x), kernels.linear(x, *args, activation_bits=8) + bias)
        assert torch.equal(module(x[:5]), kernels.linear(x[:5], *args) + bias)
        assert not torch.equal(module(x), kernels.linear(x, *args) + bias)
        with kernels.forced(None):
            fallback = module(x).double()
    q, row_scale = _rounded_rows(x, 127)
    rounded = q.double() * row_scale.double()[:, None]
    exact = F.linear(rounded, dequantized.double(), bias.double())
    assert ((fallback - exact).abs() <= gemm_error_bound(rounded.float(), dequantized, torch.float32)).all()


@pytest.mark.parametrize("prefill_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_prefill_runs_the_packed_gemm_or_the_dequantized_form_in_its_dtype(
    group_size: int, prefill_dtype: str, isa: str
) -> None:
    """A prefill-sized batch in float32 runs the GEMM over the packed weights: the kernels' exact definition, bit
    for bit, within the int16 rounding of the activations; in bfloat16 it dequantizes natively and runs one GEMM
    in that dtype, within its rounding of the exact product (emulated where the CPU lacks it)."""
    x, tensors, dequantized, _bias = _int4_case(150, group_size)
    module = Int4Linear(
        Int4(group_size=group_size), tensors["qweight"], tensors["scale"], tensors["zero_point"], None
    )
    module.prefill_dtype = PREFILL_DTYPES[prefill_dtype]
    with torch.inference_mode():
        got = module(x).double()
    exact = F.linear(x.double(), dequantized.double())
    if prefill_dtype == "float32":
        assert torch.equal(got.float(), _exact_int4_reference(x, tensors, group_size))
        assert ((got - exact).abs() <= int16_rounding_bound(x, dequantized)).all()
    else:
        assert ((got - exact).abs() <= gemm_error_bound(x, dequantized, torch.bfloat16)).all()


def test_int4_keeps_one_copy_of_its_weights_with_the_native_kernels(isa: str) -> None:
    """torch's int4pack layout is a second copy of the weights: built only when its kernel runs."""
    from quantize.runtime.modules import fuse_linears

    torch.manual_seed(0)
    scheme = Int4(group_size=32)
    modules = [
        Int4Linear(scheme, **Int4Handler().quantize(scheme, torch.randn(n, 64)), bias=None) for n in (48, 24)
    ]
    fused = fuse_linears(modules)
    assert isinstance(fused, Int4Linear)
    start = fused.qweight.data_ptr()
    assert [m.qweight.data_ptr() - start for m in modules] == [0, 48 * 32]  # rows of the fused storage
    with torch.inference_mode():
        for rows in (1, kernels.max_rows() + 1, 200):  # the kernel, then the native dequantize + GEMM
            x = torch.randn(rows, 64)
            expected = F.linear(
                x, P.dequantize_int4(P.unpack_int4(fused.qweight), fused.scale, fused.zero_point, 32)
            )
            torch.testing.assert_close(fused(x), expected, rtol=2e-3, atol=2e-3)
        assert fused._torch_pack is None
        with kernels.forced(None):  # no native kernels: torch's int4 kernel, packed on first use
            relative = (fused(x[:5]) - expected[:5]).norm() / expected[:5].norm()
        assert relative < 1e-2  # it rounds x to bf16
    assert fused._torch_pack is not None


def test_quantized_modules_route_small_batches_and_stay_exact(isa: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 40)
    scale = weight.abs().amax(1) / 127
    qweight = torch.round(weight / scale[:, None]).to(torch.int8)
    int8 = Int8Linear(Int8(), qweight, scale, torch.randn(48))
    half = HalfLinear(BF16(), weight.to(torch.bfloat16), None)
    x = torch.randn(3, 40)
    with torch.inference_mode():
        # x rounded to int16 per row (each |x| off by <= max|x| / 65534), far below the int8 weights' own error
        torch.testing.assert_close(
            int8(x), F.linear(x, qweight.float() * scale[:, None], int8.bias), rtol=2e-3, atol=1e-3
        )
        torch.testing.assert_close(half(x), F.linear(x, weight.to(torch.bfloat16).float()))
    calls = []
    real = kernels.linear

    def spy(*args: torch.Tensor, **kwargs: int) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    kernels.linear = spy  # type: ignore[assignment]
    try:
        with torch.inference_mode():
            int8(x)
            int8(torch.randn(kernels.max_rows() + 1, 40))  # every batch in one native call
            int8(torch.randn(Int8Linear.batch_invariant_rows, 40))  # a prompt on the native GEMM
            int8.prefill_dtype = torch.bfloat16
            int8(torch.randn(Int8Linear.batch_invariant_rows, 40))  # a prompt asked for in bf16: torch's GEMM
            int8(torch.randn(Int8Linear.batch_invariant_rows - 1, 40))  # under a prompt's size: native
        needs_grad = torch.randn(2, 40, requires_grad=True)
        half(needs_grad).sum().backward()  # autograd keeps torch's ops, gradients flow
    finally:
        kernels.linear = real  # type: ignore[assignment]
    rows = Int8Linear.batch_invariant_rows
    assert calls == [3, kernels.max_rows() + 1, rows, rows - 1]
    assert needs_grad.grad is not None and needs_grad.grad.abs().sum() > 0


def test_compiled_callers_see_an_opaque_custom_op(isa: str) -> None:
    weight = torch.randn(24, 16)
    x = torch.randn(2, 16)
    compiled = torch.compile(lambda a: kernels.linear(a, weight), fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, weight))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_sdpa_over_gathered_context(
    cache_dtype: torch.dtype, isa: str
) -> None:
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, d, num_slots = 6, 2, 16, 64
    k_cache = torch.randn(num_slots, kv_heads, d, generator=generator).to(cache_dtype)
    v_cache = torch.randn(num_slots, kv_heads, d, generator=generator).to(cache_dtype)
    lengths = torch.tensor([5, 12, 1])
    starts = torch.tensor([0, 4, 0])  # the second sequence attends through a sliding window
    width = int(lengths.max())
    slots = torch.zeros(3, width, dtype=torch.int64)
    for row, length in enumerate(lengths.tolist()):
        slots[row, :length] = torch.randperm(num_slots, generator=generator)[:length]
    q = torch.randn(3, heads, d, generator=generator)
    got = kernels.decode_attention(q, k_cache, v_cache, slots, starts, lengths, d**-0.5)
    for row in range(3):
        context = slots[row, int(starts[row]) : int(lengths[row])]
        keys = k_cache[context].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        values = v_cache[context].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        expected = F.scaled_dot_product_attention(q[row].unsqueeze(1), keys, values, scale=d**-0.5)
        torch.testing.assert_close(got[row], expected.reshape(-1), rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_torch(isa: str) -> None:
    x = torch.randn(5, 40) * 3
    weight = torch.rand(40) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (40,), weight, 1e-5))


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(monkeypatch, tmp_path) -> None:
    import os
    import time

    monkeypatch.setenv("QPACK_CACHE_DIR", str(tmp_path))
    flags = ["-O3", "-mavx2"]
    _name, folder = build.build_folder(flags)
    lock = folder / "lock"
    lock.touch()
    assert build.build_folder(flags)[1] == folder and lock.exists()  # a build may be running: wait for it
    old = time.time() - build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    build.build_folder(flags)
    assert not lock.exists()
    assert build.build_folder([*flags, "-mavx512f"])[1] != folder  # never an AVX-512 build on an AVX2 CPU


def test_kernels_release_the_gil(isa: str) -> None:
    """The serving engine steps in a background thread: Python threads (the HTTP loop) must run meanwhile."""
    import threading

    weight = torch.randn(4096, 4096)
    x = torch.randn(1, 4096)
    kernels.linear(x, weight)
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        progress = []
        for _ in range(5):
            before = count[0]
            for _ in range(5):
                kernels.linear(x, weight)
            progress.append(count[0] - before)
    finally:
        stop.set()
        thread.join()
    assert max(progress) > 1000, progress


def test_the_avx512_sources_compile_on_any_machine() -> None:
    """The AVX-512 build loads and runs only where the CPU has it (this file then tests it); on an AVX2 machine at
    least compile its sources, so a change that breaks the AVX-512 paths fails here too."""
    if "avx512" in kernels.runnable_isas():
        pytest.skip("this CPU executes the AVX-512 build: the tests taking `isa` run it")
    import sysconfig

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(build.SOURCE_DIR)]
    command = ["c++", "-std=c++20", "-fsyntax-only", *build.compile_flags("avx512")]
    command += ["-DTORCH_EXTENSION_NAME=qpack_check", *(f"-isystem{path}" for path in includes)]
    checks = [
        subprocess.Popen([*command, str(source)], stderr=subprocess.PIPE, text=True)
        for source in build.source_paths()
    ]
    errors = [check.communicate(timeout=600)[1] for check in checks if check.wait(timeout=600) != 0]
    assert not errors, errors[0][-3000:]


def test_the_instruction_ceilings_are_measured_for_the_build_in_use(isa: str) -> None:
    """benchmarks/prefill.py states each GEMM against these: a positive rate for every instruction, a clear
    error for any other kind."""
    assert all(kernels.peak_rate(kind, 10_000) > 0 for kind in ("int16", "int8", "fp32"))
    with pytest.raises(RuntimeError, match="'int16', 'int8' or 'fp32'"):
        kernels.peak_rate("int4", 10)
