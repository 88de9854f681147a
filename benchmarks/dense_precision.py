"""The cost of running prefill-sized GEMMs of quantized linears in bfloat16 instead of float32, same run.

For each artifact: held-out next-token KL against the FP32 reference and the time of the held-out forward (512-
token packs, the native kernels loaded as a server loads them), with the artifact's prefill dtype set to float32
(the default on every CPU) and to bfloat16 (`--prefill-dtype bfloat16`), alternating `--repeats` times (median
time). On a CPU without AMX-BF16/AVX512-BF16 the bf16 time is emulation and says nothing about those; the KL is
what transfers.

    python benchmarks/dense_precision.py --artifacts out/int8 out/int4 --calibration out/calibration
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", type=Path, nargs="+", required=True)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from quantize.io.artifact import load_artifact, read_manifest
    from quantize.io.calibration import CalibrationData
    from quantize.model.sources import load_model, resolve_model
    from quantize.quality import compare_hidden, eval_packs, reference_hidden
    from quantize.runtime.kernels import ops as kernels
    from quantize.runtime.modules import PREFILL_DTYPES, numerics, set_prefill_dtype
    from quantize.sequential.runner import BlockRunner

    kernels.enable()
    packs = eval_packs(CalibrationData.load(args.calibration), args.tokens, 0)
    reference = load_model(resolve_model(read_manifest(args.artifacts[0])["source"]["model_id"]))
    hidden = reference_hidden(reference, packs)
    head = BlockRunner(reference).lm_head
    capabilities = torch.cpu.get_capabilities()
    report: dict[str, object] = {
        "tokens": sum(p.num_tokens for p in packs),
        "native_bf16": bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16")),
        "native_kernels": kernels.isa(),
        "artifacts": {},
    }
    for path in args.artifacts:
        model = load_artifact(path).model
        seconds: dict[str, list[float]] = {dtype: [] for dtype in PREFILL_DTYPES}
        rows = {}
        for _ in range(args.repeats):
            for dtype in PREFILL_DTYPES:
                set_prefill_dtype(model, dtype)
                started = time.perf_counter()
                candidate = reference_hidden(model, packs)
                seconds[dtype].append(time.perf_counter() - started)
                quality = compare_hidden(packs, hidden, candidate, head, BlockRunner(model).lm_head)
                rows[dtype] = {
                    "kl": quality.kl,
                    "top1": quality.top1_agreement,
                    "ppl": quality.ppl,
                    "numerics": numerics(model),
                }
        for dtype, row in rows.items():
            row["seconds_median"] = round(statistics.median(seconds[dtype]), 3)
            row["seconds"] = [round(t, 3) for t in seconds[dtype]]
            print(path.name, dtype, json.dumps(row), flush=True)
        report["artifacts"][path.name] = rows  # type: ignore[index]
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
