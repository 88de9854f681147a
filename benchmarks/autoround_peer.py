"""AutoRound itself (PyPI `auto-round`, on CPU) side by side with qpack's AutoRound, GPTQ and RTN: the same model,
the same calibration tokens, the same bits and group size, the same held-out queries, in one run.

Our own AutoRound follows the paper; the question this answers is whether it matches the reference
implementation, in KL, top-1 and perplexity against FP32 and in wall time and peak RSS. The peer pins its own
transformers, so it lives in its own virtual environment in the user's cache (`--peer-python`; `--setup`
creates it: torch's CPU build first, then `auto-round`), never in the repo, and runs as a child process:

1. export: the calibration rows qpack trains on (`sample_sequences(train, calib_tokens, seed)`, the same call the
   quantize pass makes) joined into one token stream and cut into `seqlen` rows (AutoRound takes fixed-length
   rows; qpack packs the same sequences with a block-diagonal mask, so the two see the same tokens and only the
   attention across sequence boundaries differs);
2. peer: AutoRound on those rows (batch of one row, `iters` steps, lr 1/iters, asymmetric int4, FP32: `amp`
   off, as qpack's), then every quantized linear's dequantized weight written to safetensors;
3. measure: the FP32 model with those weights, against FP32 on the held-out packs the manifests report on
   (`eval_packs`), by the same `compare_to_reference`;
4. ours: `quantize_runs.run` for RTN, GPTQ and AutoRound at the same settings (each in its own process).

    python benchmarks/autoround_peer.py --calibration out/calibration --out out/bench-autoround-peer \\
        [--group 64] [--iters 200] [--calib-tokens 8192] [--setup] [--only peer gptq]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantize_runs import run

PEER_VERSION = "0.16.1"
PEER_VENV = Path.home() / ".cache" / "qpack-peers" / "autoround-venv"

PEER = r"""
import json, resource, sys, time
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(spec["model"])
rows = load_file(spec["tokens"])["rows"]
dataset = [rows[i : i + 1] for i in range(rows.shape[0])]
from auto_round import AutoRound
options = dict(
    bits=spec["bits"], group_size=spec["group"], sym=False, iters=spec["iters"], seqlen=rows.shape[1],
    nsamples=rows.shape[0], batch_size=1, dataset=dataset, device_map="cpu", amp=False, seed=0,
)
if spec["compile"] is not None:
    options["enable_torch_compile"] = spec["compile"]
started = time.perf_counter()
autoround = AutoRound(model, tokenizer, scheme="W4A16" if spec["bits"] == 4 else "W8A16", **options)
autoround.quantize()
seconds = time.perf_counter() - started
weights = {}
for name, module in model.named_modules():
    if isinstance(module, torch.nn.Linear) and ".layers." in name and getattr(module, "scale", None) is not None:
        weights[name + ".weight"] = module.weight.detach().float().contiguous()
save_file(weights, spec["weights"])
print(json.dumps({
    "seconds": seconds,
    "peak_rss_mb": next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")),
    "layers": len(weights),
    "version": __import__("auto_round").__version__,
    "options": {k: v for k, v in options.items() if k != "dataset"},
}))
"""


def setup_peer(python: Path, requirement: str = f"auto-round=={PEER_VERSION}") -> None:
    """Create a peer's virtual environment with `requirement` (torch's CPU build pinned first, so pip never pulls
    CUDA)."""
    venv = python.parent.parent
    if python.exists():
        return
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "torch==2.13.0"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement], check=True)


def export_rows(calibration: Path, calib_tokens: int, seqlen: int, seed: int, out: Path) -> tuple[Path, int]:
    """The calibration rows qpack's pass samples, as one stream cut into `seqlen` rows (`rows`, [n, seqlen])."""
    import torch
    from safetensors.torch import save_file

    from quantize.io.calibration import CalibrationData
    from quantize.sequential.packing import sample_sequences

    data = CalibrationData.load(calibration)
    stream = torch.cat([s.flatten() for s in sample_sequences(data.train, calib_tokens, seed)])
    count = stream.numel() // seqlen
    if count < 1:
        raise SystemExit(
            f"{calib_tokens} calibration tokens make no {seqlen}-token row; raise --calib-tokens"
        )
    path = out / "peer-rows.safetensors"
    save_file(
        {"rows": stream[: count * seqlen].reshape(count, seqlen).to(torch.int64).contiguous()}, str(path)
    )
    return path, count * seqlen


def model_folder(calibration: Path) -> Path:
    from quantize.io.calibration import CalibrationData
    from quantize.model.sources import resolve_model

    data = CalibrationData.load(calibration, verify=False)
    return Path(resolve_model(data.manifest["model"].get("id")).path)


def measure_peer(calibration: Path, weights: Path, eval_tokens: int, seed: int) -> dict[str, float]:
    """The peer's dequantized weights in the FP32 model, against FP32 on qpack's held-out packs."""
    import torch
    from safetensors.torch import load_file

    from quantize.io.calibration import CalibrationData
    from quantize.model.sources import load_model, resolve_model
    from quantize.quality import compare_to_reference, eval_packs, reference_hidden
    from quantize.sequential.runner import BlockRunner

    data = CalibrationData.load(calibration)
    source = resolve_model(data.manifest["model"].get("id"))
    reference, candidate = load_model(source, torch.float32), load_model(source, torch.float32)
    state = load_file(str(weights))
    missing = [name for name in state if name not in dict(candidate.named_parameters())]
    if missing:
        raise SystemExit(f"the peer wrote weights the model does not have: {missing[:3]}")
    with torch.no_grad():
        parameters = dict(candidate.named_parameters())
        for name, value in state.items():
            parameters[name].copy_(value)
    packs = eval_packs(data, eval_tokens, seed)
    quality = compare_to_reference(
        candidate, packs, reference_hidden(reference, packs), BlockRunner(reference).lm_head
    )
    return quality.to_json()


def run_peer(args: argparse.Namespace, rows: Path) -> dict[str, object]:
    spec = {
        "model": str(model_folder(args.calibration)),
        "tokens": str(rows),
        "bits": 4,
        "group": args.group,
        "iters": args.iters,
        "weights": str(args.out / "peer-weights.safetensors"),
        "compile": args.peer_compile,
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [str(args.peer_python), "-c", PEER, json.dumps(spec)], capture_output=True, text=True, check=False
    )
    (args.out / "peer.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"auto-round failed (log: {args.out / 'peer.log'}):\n{proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    result["quality"] = measure_peer(args.calibration, Path(spec["weights"]), args.eval_tokens, args.seed)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("out/bench-autoround-peer"))
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", type=Path, default=PEER_VENV / "bin" / "python")
    parser.add_argument(
        "--peer-compile", type=lambda s: s == "on", default=None, help="on|off (peer default)"
    )
    parser.add_argument(
        "--setup", action="store_true", help="create the peer's virtual environment if missing"
    )
    parser.add_argument("--only", nargs="*", choices=["peer", "rtn", "gptq", "autoround"])
    args = parser.parse_args()
    if args.setup:
        setup_peer(args.peer_python)
    if not args.peer_python.exists() and (not args.only or "peer" in args.only):
        raise SystemExit(f"no auto-round environment at {args.peer_python}; run with --setup to create it")
    args.out.mkdir(parents=True, exist_ok=True)
    int4 = {
        "preset": "int4",
        "group_size": args.group,
        "calib_tokens": args.calib_tokens,
        "eval_tokens": args.eval_tokens,
    }
    ours: dict[str, dict[str, object]] = {
        "rtn": {**int4, "algorithm": {"name": "rtn"}},
        "gptq": {**int4, "algorithm": {"name": "gptq"}},
        "autoround": {
            **int4,
            "algorithm": {"name": "autoround", "iters": args.iters, "batch_tokens": args.seqlen},
        },
    }
    results: dict[str, dict[str, object]] = {}
    for name in args.only or ["peer", *ours]:
        if name == "peer":
            rows, tokens = export_rows(args.calibration, args.calib_tokens, args.seqlen, args.seed, args.out)
            results[name] = run_peer(args, rows)
            results[name]["calib_tokens_used"] = tokens
        else:
            results[name] = run(f"int4-g{args.group}-{name}", args.calibration, args.out, dict(ours[name]))
        r, q = results[name], results[name]["quality"]
        assert isinstance(q, dict)
        print(
            f"{name:10s} KL {q['kl']:.5f} top1 {q['top1_agreement']:.3f} ppl {q['ppl']:.2f}/{q['ppl_reference']:.2f}"
            f" time {r['seconds']:.0f}s rss {r['peak_rss_mb']:.0f}MB",
            flush=True,
        )
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "group": args.group,
        "iters": args.iters,
        "calib_tokens": args.calib_tokens,
        "results": results,
    }
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
