"""Measure `qpack quantize` against its targets on the default model (SmolLM2-135M) in one run.

Each configuration runs in its own process (so peak RSS is its own), on the same calibration directory, and
reports size, KL / top-1 / perplexity against FP32 on held-out queries, wall time and peak RSS. The
reference numbers (uniform int4/g64 RTN, the FP32 size) are measured in the same run, so ratios hold on a
noisy machine.

    python benchmarks/quantize_targets.py --calibration out/calibration --out out/bench-quantize
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize_runs import run

RUNS: dict[str, dict[str, object]] = {
    "int8": {"preset": "int8"},
    "int4-g64-rtn": {"preset": "int4", "group_size": 64, "algorithm": {"name": "rtn"}},
    "int4-g64-gptq": {"preset": "int4", "group_size": 64, "algorithm": {"name": "gptq"}},
    "int4-g64-awq": {"preset": "int4", "group_size": 64, "algorithm": {"name": "awq"}},
    "mixed": {"preset": "mixed"},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("out/bench-quantize"))
    parser.add_argument("--only", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.only:
        sensitivity = args.calibration / "sensitivity.json"
        cold = not sensitivity.exists()
        results[name] = run(name, args.calibration, args.out, dict(RUNS[name]))
        results[name]["sensitivity_cold"] = cold
        r = results[name]
        print(
            f"{name:15s} KL {r['quality']['kl']:.4f} top1 {r['quality']['top1_agreement']:.3f} "
            f"ppl {r['quality']['ppl']:.2f}/{r['quality']['ppl_reference']:.2f} size {r['size']['ratio_to_fp32']:.3f} "
            f"bits {r['size']['avg_bits_quantized']:.3f} time {r['seconds']:.0f}s rss {r['peak_rss_mb']:.0f}MB",
            flush=True,
        )
    rtn = results.get("int4-g64-rtn", {}).get("quality", {}).get("kl")
    targets = {}
    if "int8" in results:
        targets["int8 size <= 45% of FP32"] = results["int8"]["size"]["ratio_to_fp32"] <= 0.45
        targets["int8 KL <= 0.002"] = results["int8"]["quality"]["kl"] <= 0.002
    if rtn:
        if "mixed" in results:
            targets["mixed bits <= 5.0"] = results["mixed"]["size"]["avg_bits_quantized"] <= 5.0
            targets["mixed KL <= RTN/5"] = results["mixed"]["quality"]["kl"] <= rtn / 5
        for name in ("int4-g64-gptq", "int4-g64-awq"):
            if name in results:
                targets[f"{name} beats RTN"] = results[name]["quality"]["kl"] < rtn
    for name, r in results.items():
        targets[f"{name} <= 5 min"] = r["seconds"] <= 300
    summary = {"date": time.strftime("%Y-%m-%d"), "results": results, "targets": targets}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    for target, ok in targets.items():
        print(f"{'PASS' if ok else 'FAIL'}  {target}")


if __name__ == "__main__":
    main()
