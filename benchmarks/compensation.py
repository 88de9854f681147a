"""Learned compensation against one-shot methods on the default model, in one run: RTN, GPTQ and AutoRound
(started from RTN and from GPTQ) at int4/g64, int4/g128 and int8, and GPTQ and AutoRound followed by `--distill`.

Each configuration runs in its own process on the same calibration directory (so peak RSS is its own) and
reports KL / top-1 / perplexity against FP32 on the same held-out queries, wall time and peak RSS. GPTQ and
RTN are measured in the same run, so the ratios hold on a noisy machine. SmolLM2's weights sit on a 4-bit g32
grid: judge int4 at g64 and g128.

    python benchmarks/compensation.py --calibration out/calibration --out out/bench-compensation [--iters 200]
        [--distill-minutes 10] [--calib-tokens 8192] [--only int4-g128-gptq int4-g128-gptq-distill]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize_runs import run

GROUPS = (64, 128)


def configurations(
    iters: int, batch_tokens: int, distill_minutes: float, calib_tokens: int
) -> dict[str, dict[str, object]]:
    runs: dict[str, dict[str, object]] = {}
    autoround = {"iters": iters, "batch_tokens": batch_tokens}
    distill = {"distill": {"minutes": distill_minutes}}
    for group in GROUPS:
        int4 = {"preset": "int4", "group_size": group, "calib_tokens": calib_tokens}
        runs[f"int4-g{group}-rtn"] = {**int4, "algorithm": {"name": "rtn"}}
        runs[f"int4-g{group}-gptq"] = {**int4, "algorithm": {"name": "gptq"}}
        runs[f"int4-g{group}-gptq-distill"] = {**int4, "algorithm": {"name": "gptq"}, **distill}
        runs[f"int4-g{group}-autoround"] = {**int4, "algorithm": {"name": "autoround", **autoround}}
        runs[f"int4-g{group}-autoround-distill"] = {
            **int4,
            "algorithm": {"name": "autoround", **autoround},
            **distill,
        }
        runs[f"int4-g{group}-autoround-from-gptq"] = {
            **int4,
            "algorithm": {"name": "autoround", "init": "gptq", **autoround},
        }
    int8 = {"preset": "int8", "calib_tokens": calib_tokens}
    runs["int8-gptq"] = {**int8, "algorithm": {"name": "gptq"}}
    runs["int8-gptq-distill"] = {**int8, "algorithm": {"name": "gptq"}, **distill}
    runs["int8-autoround"] = {**int8, "algorithm": {"name": "autoround", **autoround}}
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("out/bench-compensation"))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--distill-minutes", type=float, default=10.0)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = configurations(args.iters, args.batch_tokens, args.distill_minutes, args.calib_tokens)
    results: dict[str, dict[str, object]] = {}
    for name in args.only or list(runs):
        r = results[name] = run(name, args.calibration, args.out, dict(runs[name]))
        q = r["quality"]
        assert isinstance(q, dict)
        print(
            f"{name:28s} KL {q['kl']:.5f} top1 {q['top1_agreement']:.3f} ppl {q['ppl']:.2f}/{q['ppl_reference']:.2f}"
            f" time {r['seconds']:.0f}s rss {r['peak_rss_mb']:.0f}MB",
            flush=True,
        )
    ratios = {}
    for group in GROUPS:
        gptq = results.get(f"int4-g{group}-gptq")
        for variant in ("autoround", "autoround-from-gptq", "gptq-distill", "autoround-distill"):
            learned = results.get(f"int4-g{group}-{variant}")
            if gptq and learned:
                g, a = gptq["quality"], learned["quality"]
                assert isinstance(g, dict) and isinstance(a, dict)
                gap = g["ppl"] - g["ppl_reference"]
                ratios[f"int4-g{group} {variant} KL / GPTQ's"] = a["kl"] / g["kl"]
                ratios[f"int4-g{group} {variant} perplexity gap closed vs GPTQ"] = (
                    1 - (a["ppl"] - a["ppl_reference"]) / gap if gap > 0 else None
                )
    summary = {"date": time.strftime("%Y-%m-%d"), "iters": args.iters, "results": results, "ratios": ratios}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    for label, value in ratios.items():
        print(f"{label}: {value:.3f}" if value is not None else f"{label}: -")


if __name__ == "__main__":
    main()
