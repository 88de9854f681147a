"""Measure `qpack serve` against its targets on the default int8 artifact, baselines in the same run.

1. Throughput at 16 concurrent ShareGPT requests vs the naive one-at-a-time HF `generate` server (FP32).
2. KV memory waste at peak (allocated-but-unused slots / allocated), scraped from /metrics during the run.
3. Soak: 1,000 requests with random client aborts -> no server errors, and the KV pool back to 100% free.

    python benchmarks/serve_targets.py --artifact out/perf/int8 --out out/bench-serve-targets
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qpack.bench.serving import ServeBenchConfig, run_serve_bench


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("out/bench-serve-targets"))
    parser.add_argument("--soak-requests", type=int, default=1000)
    parser.add_argument("--max-output-tokens", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    throughput = run_serve_bench(
        ServeBenchConfig(
            artifact=args.artifact,
            levels=(16,),
            requests_per_level=32,
            max_output_tokens=args.max_output_tokens,
        )
    )
    level = throughput["levels"][0]
    soak = run_serve_bench(
        ServeBenchConfig(
            artifact=args.artifact,
            baseline="none",
            levels=(32,),
            requests_per_level=args.soak_requests,
            max_output_tokens=32,
            abort_fraction=0.3,
            max_seconds=3600,
        )
    )
    soak_level = soak["levels"][0]["artifact"]
    targets = {
        "16 concurrent: output tokens/s >= 6x naive": level["tokens_per_s_ratio"] >= 6.0,
        "KV waste at peak < 4%": level["artifact"]["peak_kv_waste"] < 0.04,
        "soak: 0 errors": soak_level["errors"] == 0,
        "soak: KV pool 100% free afterwards": soak["final_kv_blocks_used"] == 0,
    }
    summary = {
        "tokens_per_s_ratio": level["tokens_per_s_ratio"],
        "requests_per_s_ratio": level["requests_per_s_ratio"],
        "qpack_tokens_per_s": level["artifact"]["output_tokens_per_s"],
        "naive_tokens_per_s": level["baseline"]["output_tokens_per_s"],
        "peak_kv_waste": level["artifact"]["peak_kv_waste"],
        "soak": {k: soak_level[k] for k in ("completed", "aborted", "errors", "unfinished")},
        "soak_final_kv_blocks_used": soak["final_kv_blocks_used"],
        "targets": targets,
    }
    (args.out / "results.json").write_text(
        json.dumps({"throughput": throughput, "soak": soak, "summary": summary}, indent=2, default=str)
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
