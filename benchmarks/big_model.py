"""7B-class memory and time: calibrate, quantize and serve a synthetic model of Llama-3-8B's shape.

No 7B checkpoint is reachable here, so the benchmark writes one: Llama-3-8B's shape (hidden 4096, 32 layers,
intermediate 14336, 32 heads, 8 KV heads) with SmolLM2's tokenizer and vocabulary (so calibration reads real
queries), random bf16 weights in ~2 GB safetensors shards with the Hugging Face index: ~15 GB in a cache folder,
generated once, never committed. Quality is measured on the real small models; this measures memory and time
at real widths. Each step runs as its own process (`python -m qpack ...`), its peak RSS sampled with psutil
across its process tree:

- `qpack calibrate` on 128 ShareGPT samples, then `qpack quantize` with --preset int8 (RTN, and GPTQ),
  int4/g128 GPTQ (also after `--rotate hadamard`: the rotation is streamed, block by block, with the
  rest), the mixed preset (Fisher sensitivity), and int4/g128 AutoRound followed by `--distill` (few
  steps of each: their peak is what is measured): targets peak RSS <= 6 GB (int8) and 8 GB.
- `qpack serve` of the int8 artifact answering a chat request: target peak RSS <= artifact + 1.5 GB + KV pool;
  decode tokens/s at batch 1 against the memory-bound ceiling (bytes read per token / measured bandwidth).

    python benchmarks/big_model.py --out out/big            # everything (hours on 2 cores)
    python benchmarks/big_model.py --layers 2 --out out/big2 # the same steps on a 2-layer model (minutes)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
QUANTIZE_RUNS: dict[str, list[str]] = {
    "int8-rtn": ["--preset", "int8", "--algorithm", "rtn"],
    "int8-gptq": ["--preset", "int8", "--algorithm", "gptq"],
    "int4-g128-gptq": ["--preset", "int4", "--group-size", "128", "--algorithm", "gptq"],
    "int4-g128-gptq-rot": [
        "--preset",
        "int4",
        "--group-size",
        "128",
        "--algorithm",
        "gptq",
        "--rotate",
        "hadamard",
    ],
    "mixed-fisher": ["--preset", "mixed", "--sensitivity", "fisher"],
    # memory, not quality: a few AutoRound steps and minutes of distillation hold what a full run holds
    "int4-g128-autoround-distill": [
        *("--preset", "int4", "--group-size", "128", "--algorithm", "autoround", "--autoround-iters", "20"),
        *("--distill", "--distill-minutes", "3"),
    ],
}


def synthetic_model(folder: Path, layers: int, shard_bytes: int = 2 * 10**9) -> Path:
    """Llama-3-8B's shape with `layers` blocks, random bf16 weights (std 0.02, norms 1) in shards; SmolLM2's
    tokenizer. Written tensor by tensor (one shard in memory at most), reused when complete."""
    import torch
    from safetensors.torch import save_file

    from quantize.model.sources import resolve_model

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    smol = resolve_model("smollm2-135m").path
    config = json.loads((smol / "config.json").read_text())
    config.update(
        SHAPE, num_hidden_layers=layers, head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    )
    config.pop("rope_scaling", None)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for path in smol.iterdir():
        if path.name.startswith("tokenizer") or path.name in (
            "chat_template.jinja",
            "generation_config.json",
        ):
            shutil.copy2(path, tmp / path.name)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)
        shard.clear()

    for name, shape in _tensors(config):
        if "norm" in name:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shard and sum(t.numel() * 2 for t in shard.values()) + tensor.numel() * 2 > shard_bytes:
            flush()
        shard[name] = tensor
    flush()
    renamed = {old: f"model-{i:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files, start=1)}
    for old, new in renamed.items():
        (tmp / old).rename(tmp / new)
    index = {"metadata": {}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


class PeakRss:
    """Peak RSS of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            try:
                tree = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                continue

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def step(name: str, args: list[str], log: Path) -> dict[str, Any]:
    """One `qpack` command in its own process: wall time, peak RSS, its --json result."""
    command = [sys.executable, "-m", "qpack", "--json", *args]
    started = time.perf_counter()
    with open(log, "a") as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=handle, text=True)
        watch = PeakRss(proc.pid)
        stdout, _ = proc.communicate()
        peak = watch.stop()
    seconds = time.perf_counter() - started
    print(
        f"{name}: exit {proc.returncode}, {seconds / 60:.1f} min, peak RSS {peak / 2**30:.2f} GiB", flush=True
    )
    result = json.loads(stdout) if stdout.strip() else {}
    return {
        "exit": proc.returncode,
        "seconds": round(seconds, 1),
        "peak_rss_gib": round(peak / 2**30, 3),
        "result": result,
    }


def serve_check(artifact: Path, kv_memory: str, log: Path) -> dict[str, Any]:
    """`qpack serve` of the artifact: one chat request (streamed, to time decode), peak RSS, the ceiling."""
    import httpx

    from qpack.bench.sysinfo import memory_bandwidth_gbs
    from serve.http import free_port

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "qpack",
        "serve",
        str(artifact),
        "--port",
        str(port),
        "--kv-memory",
        kv_memory,
    ]
    with open(log, "a") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=handle)
        watch = PeakRss(proc.pid)
        started = time.perf_counter()
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", proc, 3600)
            load_s = time.perf_counter() - started
            body = {
                "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            stamps: list[float] = []
            request_started = time.perf_counter()
            with httpx.stream(
                "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        stamps.append(time.perf_counter())
        finally:
            proc.terminate()
            proc.wait(timeout=300)
            peak = watch.stop()
    manifest = json.loads((artifact / "manifest.json").read_text())
    weights = manifest["size"]["file_bytes"]
    bandwidth = memory_bandwidth_gbs()
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 else float("nan")
    return {
        "load_s": round(load_s, 1),
        "ttft_s": round(stamps[0] - request_started, 2) if stamps else None,
        "decode_tokens_per_s": round(decode, 3),
        "ceiling_tokens_per_s": round(bandwidth * 1e9 / weights, 3),
        "bandwidth_gbs": round(bandwidth, 1),
        "artifact_gib": round(weights / 2**30, 3),
        "kv_memory": kv_memory,
        "peak_rss_gib": round(peak / 2**30, 3),
    }


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see the log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "big")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the synthetic model is kept")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=512)
    parser.add_argument("--runs", default=",".join(QUANTIZE_RUNS))
    parser.add_argument("--kv-memory", default="256MB")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    results_path = out / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.is_file() else {}

    def save() -> None:
        results_path.write_text(json.dumps(results, indent=2))

    started = time.perf_counter()
    model = synthetic_model(args.model_dir or out / f"llama3-8b-shape-{args.layers}L", args.layers)
    results["model"] = {
        "path": str(model),
        "layers": args.layers,
        "gib_on_disk": round(sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**30, 2),
        "generate_s": round(time.perf_counter() - started, 1),
    }
    save()
    calibration = out / "calibration"
    if "calibrate" not in results or results["calibrate"]["exit"] != 0:
        results["calibrate"] = step(
            "calibrate",
            ["calibrate", "-m", str(model), "-n", str(args.samples), "-o", str(calibration), "--overwrite"],
            log,
        )
        save()
    for name in [r for r in args.runs.split(",") if r]:
        if results.get("quantize", {}).get(name, {}).get("exit") == 0:
            continue
        command = [
            "quantize",
            "-c",
            str(calibration),
            "-o",
            str(out / name),
            "--eval-tokens",
            str(args.eval_tokens),
            "--overwrite",
            *QUANTIZE_RUNS[name],
        ]
        outcome = step(name, command, log)
        manifest = outcome.pop("result", {}).get("manifest", {})
        outcome.update(
            timings=manifest.get("timings_s"),
            memory=manifest.get("memory"),
            quality=manifest.get("quality"),
            size_gib=round(manifest.get("size", {}).get("file_bytes", 0) / 2**30, 3),
            sensitivity=manifest.get("quantization", {}).get("plan_info", {}).get("sensitivity"),
        )
        results.setdefault("quantize", {})[name] = outcome
        save()
    served = out / "int8-gptq" if (out / "int8-gptq" / "manifest.json").is_file() else out / "int8-rtn"
    if (served / "manifest.json").is_file():
        results["serve"] = serve_check(served, args.kv_memory, log)
        kv = _bytes(args.kv_memory)
        results["serve"]["rss_target_gib"] = round(results["serve"]["artifact_gib"] + 1.5 + kv / 2**30, 3)
        save()
    print(json.dumps(results, indent=2))


def _bytes(text: str) -> int:
    from quantize.common.sizes import parse_size

    return parse_size(text, "--kv-memory")


if __name__ == "__main__":
    main()
