"""The long fuzz run (issue 43): `--examples` hostile calls by tenant B (`tests/serve/hostile.py`: chat and
completions bodies valid, edge-case and hostile, headers, sessions-API calls) against a real server with two
tenants in one tier, while tenant A's greedy request runs alongside. Counts every status, every 5xx, every
/health failure and every time A's text differed from its text alone; writes them as JSON.

    python benchmarks/fuzz.py [--examples 20000] [--out runs/fuzz.json] [--model DIR]

The model is the tiny FP32 Llama the tests use (`../shared/models/stories260k`, or `--model`): the run is about
the server's handling of input, not the model's speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.serve.hostile import Call, Fuzzer, calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path("runs/fuzz.json"))
    parser.add_argument("--seed", type=int, default=43)
    default_model = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
    parser.add_argument("--model", type=Path, default=default_model)
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, Fuzzer(args.model, Path(tmp)).running() as fuzzer:

        @settings(
            max_examples=args.examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(call=calls)
        def run(call: Call) -> None:
            fuzzer.send(call)
            fuzzer.healthy()
            if fuzzer.tally.sent % 1000 == 0:
                print(f"{fuzzer.tally.sent} calls, {len(fuzzer.tally.server_errors)} 5xx", flush=True)

        seed(args.seed)(run)()
    tally = fuzzer.tally
    report = {
        "examples": tally.sent,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "server_errors": len(tally.server_errors),
        "server_error_samples": tally.server_errors[:20],
        "health_failures": tally.health_failures,
        "tenant_a_runs": tally.reference_runs,
        "tenant_a_mismatches": len(tally.reference_mismatches),
        "tenant_a_mismatch_samples": tally.reference_mismatches[:5],
        "seconds": round(time.monotonic() - began, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if tally.server_errors or tally.health_failures or tally.reference_mismatches:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
