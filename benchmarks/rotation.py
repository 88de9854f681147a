"""Rotations (`--rotate hadamard`) against no rotation, and against llm-compressor's QuIP and SpinQuant followed
by its GPTQ, on one model in one run: the same calibration tokens, bits, group size and held-out queries.

What is compared (issue 46):
- qpack: RTN, GPTQ and AWQ at int4/gG with and without the rotation (GPTQ with three rotation seeds, the
  calibration and held-out tokens fixed, to size the rotation's own spread); the rotation with AutoRound then `--distill`;
  the mixed preset (the same size budget, 4.75 bits) with and without it; int8 GPTQ with and without it. Each
  configuration runs in its own process (`quantize_runs.run`), so its peak RSS is its own.
- llm-compressor (PyPI `llmcompressor`, CPU, in its own virtual environment in the user's cache; `--setup`
  creates it: torch's CPU build first, then `llmcompressor`): `GPTQModifier` alone, `QuIPModifier` (rotations
  v and u, random Hadamard) + GPTQ, and `SpinQuantModifier` (R1 + R2, Hadamard) + GPTQ. It is given the
  calibration rows qpack trains on (`autoround_peer.export_rows`) and the same precision per layer as qpack's
  plan: asymmetric int4 in groups of G where a layer's inputs divide by G, symmetric per-channel int8 where
  they do not (qpack's fallback), so the bits are equal layer by layer.
- Measured the same way for both: KL, top-1 agreement and perplexity against FP32 on the held-out packs the
  manifests report on. The peer's model is read back as its effective dense weights (each quantized linear
  applied to the identity, so QuIP's online transforms are inside them) plus its embedding, norms and head
  (which SpinQuant rotates), loaded into the FP32 architecture and run by qpack's `compare_to_reference`.

    python benchmarks/rotation.py --calibration out/calibration --out out/bench-rotation --group 64 [--setup]
        [--only gptq gptq-rot peer-quip-gptq] [--iters 100] [--distill-minutes 5]

Results are written to `OUT/results.json` after every configuration, so a run cut short keeps what it had.
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
from autoround_peer import export_rows, model_folder, setup_peer
from quantize_runs import run

PEER_VERSION = "0.14.0.1"
PEER_VENV = Path.home() / ".cache" / "qpack-peers" / "llmcompressor-venv"

PEER = r"""
import json, re, sys, time
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
rows = load_file(spec["tokens"])["rows"]
dataset = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})
linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
int4 = [n for n, m in linears.items() if m.in_features % spec["group"] == 0]
int8 = [n for n in linears if n not in int4]
def targets(names):
    return ["re:^" + re.escape(n) + "$" for n in names]
groups = {}
if int4:
    groups["int4"] = QuantizationScheme(targets=targets(int4), weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=spec["group"]))
if int8:
    groups["int8"] = QuantizationScheme(targets=targets(int8), weights=QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="channel"))
recipe = []
if spec["transform"] == "quip":
    recipe.append(QuIPModifier(rotations=["v", "u"], transform_type="random-hadamard", ignore="lm_head"))
elif spec["transform"] == "spinquant":
    recipe.append(SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"))
recipe.append(GPTQModifier(config_groups=groups, ignore=["lm_head"]))
started = time.perf_counter()
oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=rows.shape[1],
        num_calibration_samples=rows.shape[0])
seconds = time.perf_counter() - started
weights = {}
with torch.no_grad():
    for name, module in linears.items():
        eye = torch.eye(module.in_features, dtype=torch.float32)
        effective = module(eye) - module(torch.zeros_like(eye[:1]))
        weights[name + ".weight"] = effective.T.contiguous()
    for name, parameter in model.named_parameters():
        if ".layers." not in name or "norm" in name:
            weights.setdefault(name, parameter.detach().float().contiguous().clone())
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = model.get_output_embeddings().weight.detach().float().contiguous().clone()
save_file(weights, spec["weights"])
import llmcompressor
print(json.dumps({
    "seconds": seconds,
    "peak_rss_mb": next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")),
    "layers": {"int4": len(int4), "int8": len(int8)},
    "version": llmcompressor.__version__,
    "recipe": [type(m).__name__ for m in recipe],
}))
"""

PEERS = ("peer-gptq", "peer-quip-gptq", "peer-spinquant-gptq")


def measure_peer(calibration: Path, weights: Path, eval_tokens: int, seed: int) -> dict[str, float]:
    """The peer's model (effective linears, its embedding, norms and head) against FP32 on the held-out packs."""
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
    head = state.pop("lm_head.weight")
    if candidate.lm_head.weight is candidate.model.embed_tokens.weight:
        candidate.lm_head.weight = torch.nn.Parameter(head.clone())
        candidate.config.tie_word_embeddings = False
    else:
        state["lm_head.weight"] = head
    parameters = dict(candidate.named_parameters())
    unknown = [name for name in state if name not in parameters]
    if unknown:
        raise SystemExit(f"the peer wrote weights the model does not have: {unknown[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            parameters[name].copy_(value)
    packs = eval_packs(data, eval_tokens, seed)
    quality = compare_to_reference(
        candidate, packs, reference_hidden(reference, packs), BlockRunner(reference).lm_head
    )
    return quality.to_json()


def run_peer(name: str, args: argparse.Namespace, rows: Path) -> dict[str, object]:
    spec = {
        "model": str(model_folder(args.calibration)),
        "tokens": str(rows),
        "group": args.group,
        "transform": name.removeprefix("peer-").removesuffix("-gptq").removesuffix("gptq") or "none",
        "weights": str(args.out / f"{name}-weights.safetensors"),
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [str(args.peer_python), "-c", PEER, json.dumps(spec)], capture_output=True, text=True, check=False
    )
    (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (log: {args.out / f'{name}.log'}):\n{proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    result["quality"] = measure_peer(args.calibration, Path(spec["weights"]), args.eval_tokens, args.seed)
    return result


def configurations(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    common = {"calib_tokens": args.calib_tokens, "eval_tokens": args.eval_tokens}
    int4 = {"preset": "int4", "group_size": args.group, **common}
    rot = {"rotate": "hadamard"}
    autoround = {"name": "autoround", "iters": args.iters, "batch_tokens": args.seqlen}
    return {
        "rtn": {**int4, "algorithm": {"name": "rtn"}},
        "rtn-rot": {**int4, "algorithm": {"name": "rtn"}, **rot},
        "gptq": {**int4, "algorithm": {"name": "gptq"}},
        "gptq-rot": {**int4, "algorithm": {"name": "gptq"}, **rot},
        "gptq-rot-seed1": {**int4, "algorithm": {"name": "gptq"}, **rot, "rotate_seed": 1},
        "gptq-rot-seed2": {**int4, "algorithm": {"name": "gptq"}, **rot, "rotate_seed": 2},
        "awq": {**int4, "algorithm": {"name": "awq"}},
        "awq-rot": {**int4, "algorithm": {"name": "awq"}, **rot},
        "int8-gptq": {"preset": "int8", "algorithm": {"name": "gptq"}, **common},
        "int8-gptq-rot": {"preset": "int8", "algorithm": {"name": "gptq"}, **common, **rot},
        "mixed": {"preset": "mixed", **common},
        "mixed-rot": {"preset": "mixed", **common, **rot},
        "autoround-distill-rot": {
            **int4,
            "algorithm": autoround,
            "distill": {"minutes": args.distill_minutes},
            **rot,
        },
    }


def summary_lines(results: dict[str, dict[str, object]]) -> list[str]:
    """The ratios the issue's targets are stated in, for whichever runs are present."""

    def kl(name: str) -> float | None:
        quality = results.get(name, {}).get("quality")
        return float(quality["kl"]) if isinstance(quality, dict) else None

    lines = []
    for numerator, denominator in (
        ("rtn-rot", "rtn"),
        ("gptq-rot", "gptq"),
        ("gptq-rot-seed1", "gptq"),
        ("gptq-rot-seed2", "gptq"),
        ("awq-rot", "awq"),
        ("autoround-distill-rot", "gptq"),
        ("mixed-rot", "mixed"),
        ("int8-gptq-rot", "int8-gptq"),
        ("gptq-rot", "peer-gptq"),
        ("gptq-rot", "peer-quip-gptq"),
        ("gptq-rot", "peer-spinquant-gptq"),
        ("peer-quip-gptq", "peer-gptq"),
        ("peer-spinquant-gptq", "peer-gptq"),
    ):
        top, bottom = kl(numerator), kl(denominator)
        if top is not None and bottom:
            lines.append(f"KL {numerator} / {denominator} = {top / bottom:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("out/bench-rotation"))
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--distill-minutes", type=float, default=5.0)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", type=Path, default=PEER_VENV / "bin" / "python")
    parser.add_argument(
        "--setup", action="store_true", help="create llm-compressor's virtual environment if missing"
    )
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    ours = configurations(args)
    names = args.only or [*ours, *PEERS]
    unknown = [n for n in names if n not in ours and n not in PEERS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {[*ours, *PEERS]}")
    if args.setup:
        setup_peer(args.peer_python, f"llmcompressor=={PEER_VERSION}")
    if any(n in PEERS for n in names) and not args.peer_python.exists():
        raise SystemExit(
            f"no llm-compressor environment at {args.peer_python}; run with --setup to create it"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    results: dict[str, dict[str, object]] = saved.get("results", {})
    rows = None
    for name in names:
        if name in PEERS:
            if rows is None:
                rows, tokens = export_rows(
                    args.calibration, args.calib_tokens, args.seqlen, args.seed, args.out
                )
            results[name] = {**run_peer(name, args, rows), "calib_tokens_used": tokens}
        else:
            results[name] = run(f"g{args.group}-{name}", args.calibration, args.out, dict(ours[name]))
        r, q = results[name], results[name]["quality"]
        assert isinstance(q, dict)
        print(
            f"{name:22s} KL {q['kl']:.5f} top1 {q['top1_agreement']:.3f} ppl {q['ppl']:.2f}/{q['ppl_reference']:.2f}"
            f" time {r['seconds']:.0f}s rss {r['peak_rss_mb']:.0f}MB",
            flush=True,
        )
        summary = {
            "date": time.strftime("%Y-%m-%d"),
            "calibration": str(args.calibration),
            "group": args.group,
            "calib_tokens": args.calib_tokens,
            "eval_tokens": args.eval_tokens,
            "iters": args.iters,
            "distill_minutes": args.distill_minutes,
            "results": results,
            "ratios": summary_lines(results),
        }
        path.write_text(json.dumps(summary, indent=2))
    print("\n".join(summary_lines(results)))


if __name__ == "__main__":
    main()
