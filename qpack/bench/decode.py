"""`qpack bench decode`: prefill and decode speed of an artifact vs its FP32 reference, measured side by side.

Each side runs in its own worker process (so each peak RSS is its own), both stay loaded, and the parent
alternates single runs between them for every batch size and repeat: slow drift of a shared machine hits
both sides alike, and medians are reported with their ratio. The artifact runs through qpack's engine (paged KV,
quantized kernels); the reference through Hugging Face `generate`. Prompts are random token ids, distinct
per sequence, with prefix caching off, so no run is flattered by cache hits.

The report also gives the physical bound for decode: bytes of weights read per generated token (at batch 1
every weight is read once per token) divided by this machine's measured read bandwidth, and a profile of one
batch-1 decode step (kernels, LM head, attention, everything else) that says where the remaining time goes.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

from qpack.bench.config import DecodeConfig
from serve.core.config import SchedulerConfig
from serve.engine import loop
from serve.engine.config import CacheConfig, SpeculationConfig


class _PeakRss:
    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def reset(self) -> None:
        """Start a new peak window at the current RSS (each measured run reports its own peak)."""
        self.peak = self.process.memory_info().rss

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.process.memory_info().rss)


def decode_bytes(model: nn.Module) -> int:
    """Bytes the decode path reads per token at batch 1: every linear's weights (as its kernels read them),
    norms, head."""
    from quantize.runtime.modules import decode_bytes as module_bytes

    return sum(module_bytes(module) for module in model.modules())


def _random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


_PROFILE_PROMPT = 64


def text_prompts(tokenizer: Any, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` tokens of real text: chat-templated ShareGPT first turns, each cut to
    its last `length` tokens (shorter ones joined with the turns after them), in a seeded order."""
    import random

    from calibrate.sources import default_queries_path, read_source

    conversations = read_source(default_queries_path()).conversations
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    prompts: list[list[int]] = []
    pending: list[int] = []
    for index in order:
        turns = conversations[index]
        if not turns or turns[0].role != "user" or not turns[0].content.strip():
            continue
        text = turns[0].content.strip()
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pending = pending + list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(pending) >= length:
            prompts.append(pending[-length:])
            pending = []
            if len(prompts) == batch:
                return prompts
    raise ValueError(f"the bundled ShareGPT export holds fewer than {batch} prompts of {length} tokens")


class _Artifact:
    def __init__(
        self,
        path: str,
        max_batch: int,
        max_len: int,
        compile_decode: bool,
        prefill_dtype: str,
        speculative: str = "off",
        draft: str | None = None,
    ) -> None:
        from serve.core.kv_cache import KVLayout
        from serve.engine.config import EngineConfig
        from serve.loading import build_engine, load_draft, load_for_serving

        loaded = load_for_serving(path)  # as `qpack serve` loads it
        self.model = loaded.model
        self.name = f"{loaded.name} v{loaded.version}"
        size = CacheConfig().block_size
        max_len += _PROFILE_PROMPT  # room for the profile request too (one sequence, after the batches)
        blocks = max_batch * (max_len // size + 2) + 8
        config = EngineConfig(
            cache=CacheConfig(
                memory=KVLayout.of(self.model.config).memory_for(blocks, size), prefix_caching=False
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=2048),
            speculation=SpeculationConfig(mode=speculative),
            compile=compile_decode,
            prefill_dtype=prefill_dtype,
        )
        drafting = speculative in ("draft", "auto")
        self.speculative = speculative
        self.engine = build_engine(loaded, config, load_draft(draft or "int4", loaded) if drafting else None)
        self.numerics = self.engine.numerics()
        if compile_decode:
            loop.warmup(self.engine)
        self.name += " (compiled)" if compile_decode else ""

    def run(self, prompts: list[list[int]], new_tokens: int, speculate: bool = True) -> dict[str, float]:
        """Prefill and decode seconds of one batch (with the engine's speculation, or `speculate` False without)."""
        from serve.core.request import SamplingParams

        speculator = self.engine.speculator
        speculator.enabled = speculate and self.speculative != "off"
        before = speculator.summary()
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        first: dict[str, float] = {}
        done: dict[str, float] = {}

        def callback(output: Any) -> None:
            now = time.perf_counter()
            first.setdefault(output.request_id, now)
            if output.finished:
                done[output.request_id] = now

        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            self.engine.add(f"b{index}-{started}", prompt, params, callback)
        while self.engine.has_work():
            self.engine.step()
        prefill_end = max(first.values())
        end = max(done.values())
        spec = speculator.summary().since(before)
        return {
            "prefill_s": prefill_end - started,
            "decode_s": end - prefill_end,
            "spec_acceptance": spec.acceptance,
            "spec_tokens_per_step": spec.tokens_per_step,
        }

    def profile(self, new_tokens: int, vocab: int) -> dict[str, Any]:
        """Where one batch-1 decode step's time goes."""
        from torch.profiler import ProfilerActivity, profile

        from serve.core.request import SamplingParams

        prompt = _random_prompts(1, _PROFILE_PROMPT, vocab, 123)[0]
        self.engine.add(
            "profile",
            prompt,
            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
            lambda _o: None,
        )
        self.engine.step()
        for _ in range(3):
            self.engine.step()
        steps = 8
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            wall = (time.perf_counter() - started) / steps
        while self.engine.has_work():
            self.engine.step()
        categories = {
            "fused decoder layers (native: linears, attention, norms)": 0.0,
            "quantized kernels": 0.0,
            "dense matmul (LM head, FP layers)": 0.0,
            "attention": 0.0,
        }
        kernel_ops = (
            "qpack::linear_int8",
            "qpack::linear_int4",
            "qpack::linear_bf16",
            "aten::_weight_int8pack_mm",
            "aten::_weight_int4pack_mm_for_cpu",
            "aten::_weight_int4pack_mm",
        )
        other = 0.0
        for event in prof.key_averages():
            seconds = event.self_cpu_time_total / 1e6 / steps
            if event.key == "qpack::decode_layers":
                categories["fused decoder layers (native: linears, attention, norms)"] += seconds
            elif event.key in kernel_ops:
                categories["quantized kernels"] += seconds
            elif event.key in (
                "qpack::linear_fp32",
                "aten::mm",
                "aten::addmm",
                "aten::matmul",
                "aten::linear",
            ):
                categories["dense matmul (LM head, FP layers)"] += seconds
            elif "scaled_dot_product" in event.key or "attention" in event.key:
                categories["attention"] += seconds
            elif event.key.startswith("aten::"):
                other += seconds
        categories["other tensor ops"] = other
        measured = sum(categories.values())
        categories["python and dispatch overhead"] = max(0.0, wall - measured)
        return {"step_ms": wall * 1e3, "breakdown_ms": {k: v * 1e3 for k, v in categories.items()}}


class _Reference:
    def __init__(self, spec: str) -> None:
        from transformers import GenerationMixin

        from quantize.model.sources import load_model, resolve_model

        source = resolve_model(spec)
        model = load_model(source)
        if not isinstance(model, GenerationMixin):
            raise TypeError(f"the reference runs `generate`, which {type(model).__name__} lacks")
        self.model = model
        self.name = f"{source.model_id} (FP32, HF generate)"

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        from transformers.generation.streamers import BaseStreamer

        stamps: list[float] = []

        class Stamp(BaseStreamer):
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                stamps.append(time.perf_counter())

        ids = torch.tensor(prompts)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                streamer=Stamp(),
            )
        end = time.perf_counter()
        first = stamps[1] if len(stamps) > 1 else end  # stamps[0]: the prompt; stamps[1]: the first new token
        return {"prefill_s": first - started, "decode_s": end - first}


def worker_main() -> None:
    """Worker loop: one JSON command per stdin line, one JSON result per stdout line."""
    from quantize.common.memory import trim_heap

    spec = json.loads(sys.stdin.readline())
    rss = _PeakRss()
    side: Any = (
        _Artifact(
            spec["target"],
            spec["max_batch"],
            spec["max_len"],
            bool(spec["compile"]),
            spec["prefill_dtype"],
            spec.get("speculative", "off"),
            spec.get("draft"),
        )
        if spec["kind"] == "artifact"
        else _Reference(spec["target"])
    )
    vocab = int(side.model.config.vocab_size)
    print(
        json.dumps(
            {
                "ready": True,
                "name": side.name,
                "decode_bytes": decode_bytes(side.model),
                "rss_bytes": rss.peak,
                "numerics": getattr(side, "numerics", None),
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        if command.get("profile"):
            print(json.dumps(side.profile(command["new_tokens"], vocab)), flush=True)
            continue
        prompts = command.get("prompts") or _random_prompts(
            command["batch"], command["prompt_tokens"], vocab, command["seed"]
        )
        gc.collect()
        trim_heap()
        rss.reset()
        plain = command.get("speculate") is False
        result = (
            side.run(prompts, command["new_tokens"], False)
            if plain
            else side.run(prompts, command["new_tokens"])
        )
        result["peak_rss_bytes"] = rss.peak
        print(json.dumps(result), flush=True)
    rss.close()


class Worker:
    def __init__(
        self,
        kind: str,
        target: str,
        max_batch: int,
        max_len: int,
        compile_decode: bool = False,
        prefill_dtype: str = "float32",
        speculative: str = "off",
        draft: str | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from qpack.bench.decode import worker_main; worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self.call(
            {
                "kind": kind,
                "target": target,
                "max_batch": max_batch,
                "max_len": max_len,
                "compile": compile_decode,
                "prefill_dtype": prefill_dtype,
                "speculative": speculative,
                "draft": draft,
            }
        )

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited with code {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"quit": True}) + "\n")
            self.process.stdin.flush()
            self.process.wait(timeout=30)


def _tokenizer(config: DecodeConfig) -> Any:
    from quantize.model.sources import load_tokenizer

    return load_tokenizer(config.artifact)


def _alternate(
    config: DecodeConfig, artifact: Worker, baseline: Worker, progress: Any
) -> dict[str, dict[int, list[dict[str, float]]]]:
    """Every repeat and batch size, the sides in turn (with `speculative`, the artifact with and without it)."""
    speculating = config.speculative != "off"
    tokenizer = _tokenizer(config) if speculating else None
    runs: dict[str, dict[int, list[dict[str, float]]]] = {"artifact": {}, "reference": {}}
    if speculating:
        runs["artifact_plain"] = {}
    total = len(config.batches) * config.repeats
    done = 0
    for repeat in range(config.repeats):
        for batch in config.batches:
            command: dict[str, Any] = {
                "batch": batch,
                "prompt_tokens": config.prompt_tokens,
                "new_tokens": config.new_tokens,
                "seed": config.seed + repeat,
            }
            if tokenizer is not None:
                command["prompts"] = text_prompts(
                    tokenizer, batch, config.prompt_tokens, config.seed + repeat
                )
            sides = [("artifact", artifact, True), ("reference", baseline, True)]
            if speculating:
                sides.insert(1, ("artifact_plain", artifact, False))
            for side, worker, speculate in sides:
                runs[side].setdefault(batch, []).append(worker.call({**command, "speculate": speculate}))
            done += 1
            if progress is not None:
                progress(done, total)
    return runs


def run_decode_bench(config: DecodeConfig, progress: Any = None) -> dict[str, Any]:
    from qpack.bench.sysinfo import machine_info, measure_bandwidth
    from quantize.io.artifact import read_manifest

    config.validate()
    manifest = read_manifest(config.artifact)
    reference = config.reference or manifest["source"]["model_id"]
    max_len = config.prompt_tokens + config.new_tokens
    probe = measure_bandwidth()
    bandwidth = probe.median_gbs
    artifact = Worker(
        "artifact",
        str(config.artifact),
        max(config.batches),
        max_len,
        config.compile,
        config.prefill_dtype,
        config.speculative,
        config.draft,
    )
    baseline = Worker("reference", reference, max(config.batches), max_len)
    try:
        runs = _alternate(config, artifact, baseline, progress)
        profile = artifact.call({"profile": True, "new_tokens": 64})
    finally:
        artifact.close()
        baseline.close()
    rows = _rows(config, runs)
    bytes_per_token = artifact.info["decode_bytes"]
    ceiling = bandwidth * 1e9 / bytes_per_token
    batch1 = next((r for r in rows if r["batch"] == 1), None)
    return {
        "kind": "decode",
        "artifact": {
            "path": str(config.artifact),
            "name": artifact.info["name"],
            "numerics": artifact.info["numerics"],
        },
        "reference": {"id": reference, "name": baseline.info["name"]},
        "settings": {
            "batches": list(config.batches),
            "prompt_tokens": config.prompt_tokens,
            "new_tokens": config.new_tokens,
            "repeats": config.repeats,
            "speculative": config.speculative,
            "draft": config.draft if config.speculative in ("draft", "auto") else None,
            "prompts": "ShareGPT text" if config.speculative != "off" else "random token ids",
        },
        "rows": rows,
        "bound": {
            "bandwidth_gbs": bandwidth,
            "bandwidth_probe": probe.to_json(),
            "artifact_bytes_per_token": bytes_per_token,
            "reference_bytes_per_token": baseline.info["decode_bytes"],
            "ceiling_tokens_per_s": ceiling,
            "batch1_fraction_of_ceiling": (batch1["artifact"]["decode_tokens_per_s"] / ceiling)
            if batch1
            else None,
        },
        "profile_batch1": profile,
        "machine": machine_info(),
    }


def _rows(config: DecodeConfig, runs: dict[str, dict[int, list[dict[str, float]]]]) -> list[dict[str, Any]]:
    """Per batch size: each side's median prefill and decode tokens/s and peak RSS, and their ratios."""
    rows = []
    for batch in config.batches:
        row: dict[str, Any] = {"batch": batch}
        for side in [s for s in ("artifact", "artifact_plain", "reference") if s in runs]:
            samples = runs[side][batch]
            prefill = statistics.median(batch * config.prompt_tokens / r["prefill_s"] for r in samples)
            decode = statistics.median(batch * (config.new_tokens - 1) / r["decode_s"] for r in samples)
            row[side] = {
                "prefill_tokens_per_s": prefill,
                "decode_tokens_per_s": decode,
                "peak_rss_mb": max(r["peak_rss_bytes"] for r in samples) / 2**20,
            }
        row["decode_ratio"] = row["artifact"]["decode_tokens_per_s"] / row["reference"]["decode_tokens_per_s"]
        row["prefill_ratio"] = (
            row["artifact"]["prefill_tokens_per_s"] / row["reference"]["prefill_tokens_per_s"]
        )
        if "artifact_plain" in runs:
            samples = runs["artifact"][batch]
            row["speculative_ratio"] = (
                row["artifact"]["decode_tokens_per_s"] / row["artifact_plain"]["decode_tokens_per_s"]
            )
            row["acceptance"] = statistics.median(r.get("spec_acceptance", 0.0) for r in samples)
            row["tokens_per_step"] = statistics.median(r.get("spec_tokens_per_step", 0.0) for r in samples)
        rows.append(row)
    return rows
