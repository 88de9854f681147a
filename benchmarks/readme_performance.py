"""Regenerate the README's performance section from scratch on the default model, in one run.

Builds (or reuses) the default calibration and the int8 / int4 / mixed artifacts, then measures, with every
baseline in the same run: quantization quality and time, decode speed vs FP32 `generate` (and the peers
torchao int8 weight-only and bitsandbytes int8), serving throughput and latency vs the naive server, and MMLU
drift. Writes `OUT/performance.md` and, with `--update-readme`, replaces the README section between the
`<!-- perf:start -->` and `<!-- perf:end -->` markers.

    python benchmarks/readme_performance.py --out out/perf --update-readme
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QPACK = [sys.executable, "-m", "qpack"]
PRESETS = {
    "int8": ["--preset", "int8"],
    "int4": ["--preset", "int4", "--group-size", "64"],
    "mixed": ["--preset", "mixed"],
}


def sh(command: list[str], log: Path) -> str:
    started = time.perf_counter()
    print("$", " ".join(command), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(command)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode not in (0, 1):
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stderr[-2000:]}")
    print(f"  done in {time.perf_counter() - started:.0f}s", flush=True)
    return proc.stdout


def peer_decode(kind: str, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """Decode tokens/s of a peer quantizer through HF generate (torchao int8 weight-only, bitsandbytes int8)."""
    code = f"""
import json, time, torch
from quantize.model.sources import resolve_model, load_model
from quantize.common.memory import release_freed_memory
release_freed_memory()
model = load_model(resolve_model("smollm2-135m"))
if "{kind}" == "torchao-int8wo":
    from torchao.quantization import quantize_, Int8WeightOnlyConfig
    quantize_(model, Int8WeightOnlyConfig())
else:
    import bitsandbytes as bnb
    from quantize.model.surgery import set_module
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            layer = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=False, has_fp16_weights=False, threshold=6.0)
            layer.load_state_dict(module.state_dict())
            set_module(model, name, layer)
ids = torch.randint(3, 49000, ({batch}, {prompt_tokens}), generator=torch.Generator().manual_seed(0))
stamps = []
from transformers.generation.streamers import BaseStreamer
class S(BaseStreamer):
    def put(self, v): stamps.append(time.perf_counter())
    def end(self): stamps.append(time.perf_counter())
best = 0.0
for _ in range(3):
    stamps.clear()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens={new_tokens}, min_new_tokens={new_tokens},
                       do_sample=False, eos_token_id=None, pad_token_id=0, streamer=S())
    best = max(best, {batch} * ({new_tokens} - 1) / (stamps[-1] - stamps[1]))
print(json.dumps({{"tokens_per_s": best}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        return float("nan")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"])


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "perf")
    parser.add_argument("--mmlu", type=Path, default=None)
    parser.add_argument("--mmlu-limit", type=int, default=5)
    parser.add_argument("--decode-batches", default="1,4,16,32")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--serve-levels", default="10,30,50")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument(
        "--tight-kv-memory", default="128MB", help="bf16 KV pool of the memory-tight serving run (c30 fits)"
    )
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--update-readme", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    calibration = out / "calibration"
    if not (calibration / "manifest.json").is_file():
        sh([*QPACK, "calibrate", "-o", str(calibration)], log)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "quality": {name: quantized(out, calibration, name, flags, log) for name, flags in PRESETS.items()},
        "decode": {name: bench_decode(out, name, args, log) for name in PRESETS},
        "peers": {
            kind: {b: peer_decode(kind, b, 128, 64) for b in (1, 16)}
            for kind in ("torchao-int8wo", "bnb-int8")
        },
        "serving": {} if args.skip_serve else bench_serving(out, args, log),
        "tight_kv_memory": args.tight_kv_memory,
        "evals": {} if args.skip_eval else mmlu_drift(out, args, log),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    markdown = render(results)
    (out / "performance.md").write_text(markdown)
    if args.update_readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        start, end = "<!-- perf:start -->", "<!-- perf:end -->"
        if start in text and end in text:
            text = text[: text.index(start) + len(start)] + "\n" + markdown + text[text.index(end) :]
            readme.write_text(text)
    print(markdown)


def quantized(out: Path, calibration: Path, name: str, flags: list[str], log: Path) -> dict[str, Any]:
    """The preset's artifact (built unless it exists) and its quantization quality."""
    artifact = out / name
    elapsed = None
    if not (artifact / "manifest.json").is_file():
        started = time.perf_counter()
        command = [*QPACK, "quantize", "-c", str(calibration), "-o", str(artifact)]
        sh([*command, "--name", f"smollm2-135m-{name}", *flags], log)
        elapsed = time.perf_counter() - started
    manifest = json.loads((artifact / "manifest.json").read_text())
    return {
        "quality": manifest["quality"],
        "size": manifest["size"],
        "summary": manifest["quantization"]["summary"],
        "seconds": elapsed,
        "timings": manifest["timings_s"],
    }


def bench_decode(out: Path, name: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    folder = out / f"bench-decode-{name}"
    command = [*QPACK, "--quiet", "bench", "decode", str(out / name), "--batches", args.decode_batches]
    sh([*command, "--repeats", str(args.decode_repeats), "--out", str(folder)], log)
    return json.loads((folder / "results.json").read_text())


def bench_serving(out: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """The int8 artifact under the ShareGPT replay: default pool, and a memory-tight bf16 pool."""
    configs = {
        "default": [],  # 512 MB FP32 KV pool
        "tight": [f"--kv-memory={args.tight_kv_memory}", "--server-arg=--kv-dtype=bfloat16"],
    }
    serving: dict[str, Any] = {}
    for label, extra in configs.items():
        folder = out / f"bench-serve-int8-{label}"
        command = [*QPACK, "--quiet", "bench", "serve", str(out / "int8"), "--concurrency", args.serve_levels]
        sh([*command, *extra, "--out", str(folder)], log)
        serving[label] = json.loads((folder / "results.json").read_text())
    return serving


def mmlu_drift(out: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    eval_out = out / "bench-eval"
    command = [
        sys.executable,
        "benchmarks/evaluate_targets.py",
        "--artifacts",
        *(str(out / n) for n in PRESETS),
    ]
    command += ["--limit", str(args.mmlu_limit), "--out", str(eval_out)]
    if args.mmlu:
        command += ["--mmlu", str(args.mmlu)]
    sh(command, log)
    return json.loads((eval_out / "results.json").read_text())


def render(results: dict[str, Any]) -> str:
    decode = results["decode"]
    machine = next(iter(decode.values()))["machine"] if decode else {}
    bound = next(iter(decode.values()))["bound"] if decode else {}
    lines = [
        f"Measured {results['date']} on {machine.get('cpu_count')} cores, {machine.get('ram_gib')} GiB RAM "
        f"({machine.get('cpu_capability')}, torch {machine.get('versions', {}).get('torch')}, {machine.get('torch_threads')} threads), "
        "SmolLM2-135M-Instruct, default calibration (512 ShareGPT queries). Reproduce: `python benchmarks/readme_performance.py`.",
        "",
        "**Quantization** (KL, top-1 and perplexity against FP32 on held-out ShareGPT queries):",
        "",
        "| preset | plan | size vs FP32 | avg bits | KL | top-1 | ppl (FP32) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, q in results["quality"].items():
        lines.append(
            f"| {name} | {q['summary']} | {q['size']['ratio_to_fp32']:.1%} | {q['size']['avg_bits_quantized']:.2f} | "
            f"{q['quality']['kl']:.4f} | {q['quality']['top1_agreement']:.1%} | {q['quality']['ppl']:.2f} ({q['quality']['ppl_reference']:.2f}) |"
        )
    lines += [
        "",
        f"**Decode** (tokens/s, median of alternating runs; memory-bound ceiling at batch 1 for int8: "
        f"{decode.get('int8', {}).get('bound', {}).get('ceiling_tokens_per_s', float('nan')):.0f} tok/s at "
        f"{bound.get('bandwidth_gbs', float('nan')):.1f} GB/s):",
        "",
        "| batch | FP32 HF generate | "
        + " | ".join(f"qpack {n}" for n in decode)
        + " | torchao int8wo | bnb int8 |",
        "| --- | --- | " + " | ".join("---" for _ in decode) + " | --- | --- |",
    ]
    rows = next(iter(decode.values()))["rows"] if decode else []
    for index, row in enumerate(rows):
        batch = row["batch"]
        cells = [
            f"{decode[n]['rows'][index]['artifact']['decode_tokens_per_s']:.1f} ({decode[n]['rows'][index]['decode_ratio']:.2f}x)"
            for n in decode
        ]
        peer = [
            f"{results['peers'][k].get(batch, float('nan')):.1f}" if batch in results["peers"][k] else "-"
            for k in ("torchao-int8wo", "bnb-int8")
        ]
        lines.append(
            f"| {batch} | {row['reference']['decode_tokens_per_s']:.1f} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(peer)
            + " |"
        )
    titles = {
        "default": "**Serving** (ShareGPT replay, chat endpoint, outputs up to 128 tokens; qpack int8 with the default "
        "512 MB FP32 KV pool):",
        "tight": "**Serving, memory-tight** (same replay; qpack int8 with a bfloat16 KV pool of "
        f"{results.get('tight_kv_memory', '128MB')}, allocated up front):",
    }
    for label, serving in (results.get("serving") or {}).items():
        from qpack.bench.report import serve_markdown

        lines += ["", titles[label], "", serve_markdown(serving).split("\n", 2)[2]]
    evals = results.get("evals")
    if evals:
        lines += [
            "",
            f"**MMLU drift** (5-shot, {evals['questions']} questions = {evals['limit']} per subject; drift in points with paired-bootstrap 95% CI):",
            "",
            "| artifact | format | accuracy (FP32) | drift | flip rate | answer KL |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for artifact in evals["artifacts"].values():
            for fmt, r in artifact["formats"].items():
                low, high = r["drift_ci95_points"]
                lines.append(
                    f"| {artifact['name']} | {fmt} | {r['candidate']['accuracy']:.1%} ({r['reference']['accuracy']:.1%}) | "
                    f"{r['drift_points']:+.2f} [{low:+.2f}, {high:+.2f}] | {r['flips']['flip_rate']:.1%} | {r['answer_kl']['mean']:.4f} |"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
