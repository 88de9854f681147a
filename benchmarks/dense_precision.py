"""The cost of running prefill-sized GEMMs of quantized linears in bfloat16 instead of float32, same run.

For each artifact: held-out next-token KL against the FP32 reference and the time of the held-out forward,
with `QPACK_DENSE_DTYPE=float32` and `bfloat16` (the choice `auto` makes on CPUs with AMX-BF16/AVX512-BF16).
On a CPU without native bf16 the bf16 time is emulation and says nothing about AMX; the KL is what transfers.

    python benchmarks/dense_precision.py --artifacts out/int8 out/int4 --calibration out/calibration
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import os

    import torch

    from quantize import modules
    from quantize.artifact import load_artifact, read_manifest
    from quantize.calibdata import CalibrationData
    from quantize.layerwise import LayerwiseModel
    from quantize.models import load_model, resolve_model
    from quantize.quality import compare_hidden, eval_packs, reference_hidden

    packs = eval_packs(CalibrationData.load(args.calibration), args.tokens, 0)
    reference = load_model(resolve_model(read_manifest(args.artifacts[0])["source"]["model_id"]))
    hidden = reference_hidden(reference, packs)
    head = LayerwiseModel(reference).lm_head
    capabilities = torch.cpu.get_capabilities()
    report: dict[str, object] = {
        "tokens": sum(p.num_tokens for p in packs),
        "native_bf16": bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16")),
        "artifacts": {},
    }
    for path in args.artifacts:
        model = load_artifact(path).model
        rows = {}
        for dtype in ("float32", "bfloat16"):
            os.environ["QPACK_DENSE_DTYPE"] = dtype
            modules.reset_dense_dtype()
            started = time.perf_counter()
            candidate = reference_hidden(model, packs)
            seconds = time.perf_counter() - started
            quality = compare_hidden(packs, hidden, candidate, head, LayerwiseModel(model).lm_head)
            rows[dtype] = {
                "kl": quality["kl"],
                "top1": quality["top1_agreement"],
                "ppl": quality["ppl"],
                "seconds": round(seconds, 2),
            }
            print(path.name, dtype, json.dumps(rows[dtype]), flush=True)
        report["artifacts"][path.name] = rows  # type: ignore[index]
    modules.reset_dense_dtype()
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
