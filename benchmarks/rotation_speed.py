"""Decode and prefill speed of artifacts with and without `--rotate hadamard` (issue 46: an absorbed rotation
should cost nothing at run time; it changes weight values, not shapes or kernels, except that a tied head is
stored untied).

In one process, alternating between the artifacts, `--repeats` rounds (a new prompt each, so no prefix is reused
from the KV cache): prefill = a `--rows`-token prompt through
the serving engine's first step (native kernels, as served); decode = the tokens/s of `--decode-tokens` greedy
tokens at batch 1 after that prompt. Medians per artifact, and each ratio to the first artifact.

    python benchmarks/rotation_speed.py out/bench-rotation-g64/g64-gptq out/bench-rotation-g64/g64-gptq-rot
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantize.runtime.kernels import ops as kernels
from serve.core.request import SamplingParams
from serve.engine.config import CacheConfig, EngineConfig
from serve.engine.core import Engine
from serve.loading import load_for_serving


def one_round(engine: Engine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of one greedy request."""
    stamps: list[float] = []
    engine.add(
        f"r{time.monotonic_ns()}",
        prompt,
        SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True),
        lambda output: stamps.extend(time.perf_counter() for _ in output.token_ids),
    )
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    return stamps[0] - started, decode_tokens / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("out/bench-rotation-speed.json"))
    args = parser.parse_args()
    kernels.enable()
    engines = {}
    for artifact in args.artifacts:
        loaded = load_for_serving(str(artifact))
        engines[artifact.name] = Engine(
            loaded.model, loaded.tokenizer, EngineConfig(cache=CacheConfig(memory="64MB"))
        )
    vocab = int(next(iter(engines.values())).model.config.vocab_size)

    def prompt(round_: int) -> list[int]:  # a new prompt each round: no prefix is ever served from the cache
        return [(17 + 7919 * (i + round_ * args.rows)) % (vocab - 10) + 5 for i in range(args.rows)]

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for engine in engines.values():
        one_round(engine, prompt(args.repeats)[:32], 8)  # warm-up
    for round_ in range(args.repeats):
        for name, engine in engines.items():
            samples[name].append(one_round(engine, prompt(round_), args.decode_tokens))
    first = next(iter(samples))
    base_prefill = statistics.median(s[0] for s in samples[first])
    base_decode = statistics.median(s[1] for s in samples[first])
    results = {}
    for name, runs in samples.items():
        prefill = statistics.median(s[0] for s in runs)
        decode = statistics.median(s[1] for s in runs)
        results[name] = {
            "prefill_tokens_per_s": args.rows / prefill,
            "decode_tokens_per_s": decode,
            "prefill_time_ratio": prefill / base_prefill,
            "decode_speed_ratio": decode / base_decode,
            "runs": runs,
        }
        print(
            f"{name:24s} prefill {args.rows / prefill:8.1f} tok/s ({prefill / base_prefill:.3f}x time)"
            f"  decode {decode:6.1f} tok/s ({decode / base_decode:.3f}x)"
        )
    args.out.write_text(
        json.dumps({"rows": args.rows, "decode_tokens": args.decode_tokens, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
