"""Prompt-sized products of one linear layer, per shape and per kernel build, in one run: qpack's native int8 and
int4 kernels (the activation rounded to int16 per row; int8 as a packed-panel GEMM, and on AMX tiles where the CPU
has them, int4 as a GEMM over the packed nibbles, all bit-identical to decode), the same with the activation rounded
to int8 (`--prefill-dtype int8`, `a8`: int4 then runs a `vpmaddubsw` GEMM), against torch's FP32 `F.linear` on an
FP32 weight (oneDNN/MKL) and the path the modules took for prompts before (dequantize into a scratch buffer, then
that GEMM).

Each build's ceilings are measured first, in the same run (`kernels.peak_rate`): the int16-pair multiply-add
(`vpmaddwd` on AVX2, `vpdpwssd` on AVX-512) and the float32 FMA, each issued in 12 independent chains per
thread on every thread, so that nothing but the core's issue rate bounds them. A GEMM's efficiency is its
multiply-adds per second over the int16 ceiling (`int16 peak %`); the a8 int4 GEMM's over its own (`a8 peak %`: one
256-bit `vpmaddubsw` per 32 multiply-adds and one widening `vpmaddwd` per eight of those).

Shapes: SmolLM2-135M's projections (fused q/k/v and gate/up, as the runtime fuses them) and Llama-3-8B's widths.
Every build this CPU can execute is measured (`kernels.forced`: AVX2 on an AVX-512 machine too). Each number is
the median of `--repeats` timed calls after a warm-up, as GOP/s (2 M N K per call).

With `--artifact DIR` (repeatable: an int8 and an int4 artifact of one model) it also times a whole prompt's
forward (`--rows` tokens, the model's own tokens cycled), in one process, alternating, median of `--repeats`: each
artifact on the native prompt GEMMs (on AMX tiles where the CPU has them, and then also without), on them with int8
activations, the same artifact with prompts as dequantize + float32 GEMM (the path before), and the FP32 model they were built from.
This is the path `qpack evaluate` and the lm-eval adapter run (`load_artifact`, Hugging Face's forward).

    python benchmarks/prefill.py [--rows 512] [--repeats 7] [--artifact DIR ...] [--out out/bench-prefill.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantize.formats import primitives as P
from quantize.formats.schemes import Int4, Int8
from quantize.runtime.handlers import Int4Handler
from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import Int4Linear, Int8Linear, prefill_dtype_set

SHAPES = {  # name: (K inputs, N outputs)
    "smollm2 qkv": (576, 960),
    "smollm2 o": (576, 576),
    "smollm2 gate_up": (576, 3072),
    "smollm2 down": (1536, 576),
    "8b q": (4096, 4096),
    "8b gate": (4096, 14336),
    "8b down": (14336, 4096),
}


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(name: str, k: int, n: int, rows: int, repeats: int, group: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    x = torch.randn(rows, k, generator=generator)
    int8 = Int8Linear(
        Int8(),
        torch.round(weight / (weight.abs().amax(1, keepdim=True) / 127)).to(torch.int8),
        weight.abs().amax(1) / 127,
        None,
    )
    tensors = Int4Handler().quantize(Int4(group_size=group), weight)
    int4 = Int4Linear(
        Int4(group_size=group), tensors["qweight"], tensors["scale"], tensors["zero_point"], None
    )
    ops = 2 * rows * n * k / 1e9
    result: dict[str, float | int] = {"k": k, "n": n, "rows": rows}
    with torch.inference_mode():
        result["torch fp32"] = ops / median_seconds(lambda: F.linear(x, weight), repeats)
        scratch = torch.empty(n, k)

        def dequantized_int8() -> torch.Tensor:
            return F.linear(x, P.dequantize_int8(int8.qweight[:, :k], int8.scale, out=scratch))

        def dequantized_int4() -> torch.Tensor:
            kernels.dequantize_int4(int4.qweight, int4.scale, int4.zero_point, scratch)
            return F.linear(x, scratch)

        result["dequantize+gemm int8"] = ops / median_seconds(dequantized_int8, repeats)
        for isa in kernels.runnable_isas():
            with kernels.forced(isa):
                if isa == kernels.runnable_isas()[-1]:
                    result["dequantize+gemm int4"] = ops / median_seconds(dequantized_int4, repeats)

                def native_int8() -> torch.Tensor:
                    return kernels.linear(x, int8.qweight, int8.scale)

                with kernels.forced_amx(False):
                    result[f"native int8 {isa}"] = ops / median_seconds(native_int8, repeats)
                if kernels.amx():
                    result["native int8 amx"] = ops / median_seconds(native_int8, repeats)
                result[f"native int4 {isa}"] = ops / median_seconds(
                    lambda: kernels.linear(x, int4.qweight, int4.scale, None, int4.zero_point), repeats
                )
                with kernels.forced_amx(False):
                    result[f"native int8 a8 {isa}"] = ops / median_seconds(
                        lambda: kernels.linear(x, int8.qweight, int8.scale, activation_bits=8), repeats
                    )
                result[f"native int4 a8 {isa}"] = ops / median_seconds(
                    lambda: kernels.linear(x, int4.qweight, int4.scale, None, int4.zero_point, 8), repeats
                )
                peak = 2 * PEAKS[isa]["int16"] / 1e9  # GOP/s
                result[f"native int8 {isa} int16 peak %"] = 100 * result[f"native int8 {isa}"] / peak
                result[f"native int4 {isa} int16 peak %"] = 100 * result[f"native int4 {isa}"] / peak
                # the a8 GEMM's ceiling: one vpmaddubsw per 32 multiply-adds plus a widening vpmaddwd per 8
                a8_peak = 2 / (1 / PEAKS[isa]["int8"] + 1 / (8 * 2 * PEAKS[isa]["int16"])) / 1e9
                result[f"native int4 a8 {isa} a8 peak %"] = 100 * result[f"native int4 a8 {isa}"] / a8_peak
    print(name, {key: round(v, 1) if isinstance(v, float) else v for key, v in result.items()}, flush=True)
    return result


PEAKS: dict[
    str, dict[str, float]
] = {}  # per build: multiply-adds per second of its int16 and fp32 instructions


def measure_peaks() -> dict[str, dict[str, float]]:
    for isa in kernels.runnable_isas():
        with kernels.forced(isa):
            PEAKS[isa] = {
                kind: max(kernels.peak_rate(kind) for _ in range(3)) for kind in ("int16", "int8", "fp32")
            }
        print(f"peaks {isa}: " + ", ".join(f"{kind} {v / 1e9:.1f} GMAC/s" for kind, v in PEAKS[isa].items()))
    return PEAKS


def model_prefill(artifacts: list[str], rows: int, repeats: int) -> dict[str, object]:
    """Seconds per prompt forward (median, alternating): each artifact's native prompt GEMMs, its dequantize +
    GEMM, and the FP32 reference."""
    from quantize.io.artifact import load_artifact
    from quantize.model.sources import load_model, resolve_model

    loaded = [load_artifact(path) for path in artifacts]
    reference = load_model(resolve_model(loaded[0].manifest["source"]["model_id"]), dtype=torch.float32)
    tokens = torch.arange(rows).remainder(reference.config.vocab_size - 1).add(1)[None]

    def forward(
        model: torch.nn.Module, native: bool, amx: bool = True, prefill: str = "float32"
    ) -> Callable[[], object]:
        def call() -> object:
            Int8Linear.native_prompts = Int4Linear.native_prompts = native
            try:
                with kernels.forced_amx(amx), prefill_dtype_set(model, prefill):
                    return model(tokens, use_cache=False).logits
            finally:
                Int8Linear.native_prompts = Int4Linear.native_prompts = True

        return call

    calls: dict[str, Callable[[], object]] = {}
    for path, artifact in zip(artifacts, loaded, strict=True):
        label = Path(path).name
        calls[f"{label} native"] = forward(artifact.model, True)
        calls[f"{label} native, int8 activations"] = forward(artifact.model, True, prefill="int8")
        if kernels.amx():
            calls[f"{label} native, AMX off"] = forward(artifact.model, True, amx=False)
        calls[f"{label} dequantize+gemm"] = forward(artifact.model, False)
    calls["fp32"] = forward(reference, True)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()
        for _ in range(repeats):
            for name, call in calls.items():
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    result: dict[str, object] = {"rows": rows, "isa": kernels.isa(), "amx": kernels.amx(), "seconds": seconds}
    result["tokens/s"] = {name: rows / value for name, value in seconds.items()}
    result["speedup vs fp32"] = {name: seconds["fp32"] / value for name, value in seconds.items()}
    print("prefill", json.dumps(result, indent=1), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument(
        "--artifact", action="append", default=[], help="an artifact: also time whole prompt forwards"
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench-prefill.json"))
    args = parser.parse_args()
    kernels.enable()
    measure_peaks()
    results = {
        name: measure(name, *SHAPES[name], args.rows, args.repeats, args.group) for name in args.shapes
    }
    from qpack.bench.sysinfo import machine_info

    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "peak GMAC/s": {isa: {k: v / 1e9 for k, v in peaks.items()} for isa, peaks in PEAKS.items()},
        "gops": results,
    }
    if args.artifact:
        summary["model"] = model_prefill(args.artifact, args.rows, args.repeats)
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
