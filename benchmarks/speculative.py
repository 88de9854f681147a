"""Speculative decoding against plain decoding of the same artifact, in one process, alternating.

One engine serves the target artifact with a draft beside it; between runs only the speculation mode changes
(off, ngram, draft, auto), so every mode runs on the same weights, KV pool and kernels, and slow drift of the
machine hits all modes alike. Per prompt and mode: decode tokens/s (first token to last, TTFT excluded),
acceptance, tokens per target step, and whether the text equals the plain run's (greedy: it must, every prompt).

Workloads:
- `sharegpt`: first user turns of the bundled ShareGPT export, chat-templated, greedy, batch 1;
- `grounded`: input-grounded prompts (repeat, correct, summarize a given passage: ShareGPT answers), batch 1;
- `batch`: B prompts decoding together for B in `--batches`, mode off vs auto (where speculation stops paying);
- `load`: ShareGPT at concurrency `--concurrency` (closed loop), output tokens/s, off vs auto.

Also writes the prompts as `prompts.json` (chat-templated text) for the llama.cpp side by side.

    python benchmarks/speculative.py TARGET [--draft DIR|int4[:G]] [--out DIR] [--prompts 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from serve.core.config import SchedulerConfig
from serve.engine.config import CacheConfig, SpeculationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("off", "ngram", "draft", "auto")
GROUNDED = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Correct the spelling and grammar of the following text and return the whole corrected text:\n\n{text}",
    "Summarize the following text, quoting its key sentences:\n\n{text}",
)


def _conversations() -> list[Any]:
    from calibrate.sources import default_queries_path, read_source

    return read_source(default_queries_path()).conversations


def prompts(tokenizer: Any, count: int, seed: int) -> dict[str, list[str]]:
    """Chat-templated prompt texts: ShareGPT first turns, and grounded ones built on ShareGPT answers."""
    conversations = _conversations()
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    chat: list[str] = []
    grounded: list[str] = []

    def template(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    for index in order:
        conversation = conversations[index]
        if len(conversation) < 2 or conversation[0].role != "user" or conversation[1].role != "assistant":
            continue
        question, answer = conversation[0].content.strip(), conversation[1].content.strip()
        if len(chat) < count and question and 8 <= length(question) <= 384:
            chat.append(template(question))
        elif len(grounded) < count and answer and 96 <= length(answer) <= 320 and "```" not in answer:
            grounded.append(template(GROUNDED[len(grounded) % len(GROUNDED)].format(text=answer)))
        if len(chat) >= count and len(grounded) >= count:
            break
    return {"sharegpt": chat, "grounded": grounded}


def _set_mode(engine: Any, mode: str) -> None:
    speculator = engine.speculator
    speculator.policy = dataclasses.replace(speculator.policy, mode=mode)
    speculator.enabled = mode != "off"
    speculator.acceptance.clear()


def _run(engine: Any, texts: list[str], max_tokens: int, mode: str, tag: str) -> list[dict[str, Any]]:
    """Decode `texts` together (greedy) in `mode`; per request: ids, tokens/s after the first token."""
    from serve.core.request import SamplingParams

    _set_mode(engine, mode)
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ids: dict[str, list[int]] = {}
    before = engine.speculator.summary()

    def collect(output: Any) -> None:
        now = time.perf_counter()
        first.setdefault(output.request_id, now)
        last[output.request_id] = now
        ids.setdefault(output.request_id, []).extend(output.token_ids)

    names = [f"{tag}-{mode}-{i}" for i in range(len(texts))]
    for name, text in zip(names, texts, strict=True):
        engine.add(name, tokenizer(text, add_special_tokens=False)["input_ids"], params, collect)
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - started
    after = engine.speculator.summary()
    results = []
    for name in names:
        tokens = ids.get(name, [])
        span = last.get(name, 0.0) - first.get(name, 0.0)
        results.append(
            {
                "ids": tokens,
                "tokens": len(tokens),
                "decode_s": span,
                "tok_s": (len(tokens) - 1) / span if span > 0 and len(tokens) > 1 else 0.0,
                "wall_s": wall,
            }
        )
    results[0]["spec"] = _difference(before, after)
    return results


def _difference(before: Any, after: Any) -> dict[str, Any]:
    spec = after.since(before)
    return {
        "proposed": spec.proposed,
        "accepted": spec.accepted,
        "acceptance": spec.acceptance,
        "verify_steps": spec.verify_steps,
        "tokens_per_step": spec.tokens_per_step,
    }


def batch1(engine: Any, texts: list[str], max_tokens: int, modes: tuple[str, ...]) -> dict[str, Any]:
    """Each prompt alone in every mode, alternating modes per prompt; per mode the totals, per prompt the
    details and whether the text equals mode off's."""
    per_prompt = []
    totals = {
        mode: {"tokens": 0, "decode_s": 0.0, "proposed": 0, "accepted": 0, "steps": 0} for mode in modes
    }
    for index, text in enumerate(texts):
        row: dict[str, Any] = {"prompt": index}
        reference: list[int] | None = None
        for mode in modes:
            result = _run(engine, [text], max_tokens, mode, f"p{index}")[0]
            if mode == "off":
                reference = result["ids"]
            spec = result.get("spec", {})
            row[mode] = {
                "tokens": result["tokens"],
                "tok_s": round(result["tok_s"], 2),
                "same_text": result["ids"] == reference,
                "acceptance": round(spec.get("acceptance", 0.0), 3),
                "tokens_per_step": round(spec.get("tokens_per_step", 0.0), 2),
            }
            total = totals[mode]
            total["tokens"] += max(0, result["tokens"] - 1)
            total["decode_s"] += result["decode_s"]
            total["proposed"] += sum(spec.get("proposed", {}).values())
            total["accepted"] += sum(spec.get("accepted", {}).values())
            total["steps"] += spec.get("verify_steps", 0)
        per_prompt.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for mode, total in totals.items():
        rate = total["tokens"] / total["decode_s"] if total["decode_s"] else 0.0
        summary[mode] = {
            "tok_s": round(rate, 2),
            "acceptance": round(total["accepted"] / total["proposed"], 3) if total["proposed"] else None,
            "all_same_text": all(row[mode]["same_text"] for row in per_prompt),
        }
    base = float(summary["off"]["tok_s"] or 0.0)
    for mode in modes:
        summary[mode]["speedup"] = round(float(summary[mode]["tok_s"] or 0.0) / base, 3) if base else None
    return {"summary": summary, "prompts": per_prompt}


def batches(engine: Any, texts: list[str], max_tokens: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    """B prompts decoding together, off vs auto, alternating: aggregate output tokens/s after the first."""
    out = {}
    for size in sizes:
        group = (texts * size)[:size]
        rates: dict[str, float] = {}
        for mode in ("off", "auto", "off", "auto"):
            results = _run(engine, group, max_tokens, mode, f"b{size}")
            tokens = sum(max(0, r["tokens"] - 1) for r in results)
            span = max(r["decode_s"] for r in results)
            rates[mode] = max(rates.get(mode, 0.0), tokens / span if span else 0.0)
        out[str(size)] = {
            "off_tok_s": round(rates["off"], 2),
            "auto_tok_s": round(rates["auto"], 2),
            "ratio": round(rates["auto"] / rates["off"], 3) if rates["off"] else None,
        }
        print(json.dumps({"batch": size, **out[str(size)]}), flush=True)
    return out


def load(engine: Any, concurrency: int, count: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """ShareGPT at a fixed concurrency (closed loop, `count` requests), off vs auto alternating twice: output
    tokens/s over the whole run."""
    from qpack.bench.serving import sharegpt_requests
    from serve.core.request import SamplingParams

    tokenizer = engine.tokenizer
    requests = sharegpt_requests(tokenizer, count, 512, max_tokens, seed)
    encoded = []
    for request in requests:
        text = tokenizer.apply_chat_template(request.prompt, tokenize=False, add_generation_prompt=True)
        encoded.append((tokenizer(text, add_special_tokens=False)["input_ids"], request.max_tokens))
    rates: dict[str, list[float]] = {"off": [], "auto": []}
    for round_index, mode in enumerate(("off", "auto", "off", "auto")):
        _set_mode(engine, mode)
        produced = {"tokens": 0}
        pending = list(enumerate(encoded))
        in_flight: set[str] = set()

        def callback(
            output: Any, produced: dict[str, int] = produced, in_flight: set[str] = in_flight
        ) -> None:
            produced["tokens"] += len(output.token_ids)
            if output.finished:
                in_flight.discard(output.request_id)

        started = time.perf_counter()
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                index, (ids, limit) = pending.pop(0)
                name = f"load{round_index}-{index}"
                in_flight.add(name)
                engine.add(
                    name, ids, SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True), callback
                )
            engine.step()
        rates[mode].append(produced["tokens"] / (time.perf_counter() - started))
        print(json.dumps({"load": mode, "tok_s": round(rates[mode][-1], 2)}), flush=True)
    off, auto = statistics.median(rates["off"]), statistics.median(rates["auto"])
    return {
        "concurrency": concurrency,
        "requests": count,
        "off_tok_s": round(off, 2),
        "auto_tok_s": round(auto, 2),
        "ratio": round(auto / off, 3),
        "runs": rates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target")
    parser.add_argument("--draft", default="int4")
    parser.add_argument("--out", default="out/bench-speculative")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--concurrency", type=int, default=30)
    parser.add_argument("--load-requests", type=int, default=60)
    parser.add_argument("--workloads", default="sharegpt,grounded,batch,load")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from quantize.runtime.kernels import ops as kernels
    from serve.engine.config import EngineConfig
    from serve.loading import build_engine, load_draft, load_for_serving

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_for_serving(args.target)
    draft = load_draft(args.draft, loaded)
    config = EngineConfig(
        cache=CacheConfig(memory="768MB", prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024),
        speculation=SpeculationConfig(
            mode="auto", k=args.k, max_batch=args.max_batch, draft_kv_memory="256MB"
        ),
    )
    engine = build_engine(loaded, config, draft)
    texts = prompts(loaded.tokenizer, args.prompts, args.seed)
    (out / "prompts.json").write_text(
        json.dumps(
            [
                {"name": f"{kind}-{i}", "kind": kind, "text": text, "max_tokens": args.max_tokens}
                for kind, group in texts.items()
                for i, text in enumerate(group)
            ],
            indent=1,
        )
    )
    _run(engine, texts["sharegpt"][:1], 8, "auto", "warmup")
    workloads = args.workloads.split(",")
    report: dict[str, Any] = {
        "target": args.target,
        "draft": args.draft,
        "cpu": kernels.isa(),
        "amx": kernels.amx(),
        "threads": torch.get_num_threads(),
        "k_max": args.k,
        "max_batch": args.max_batch,
        "max_tokens": args.max_tokens,
    }
    for kind in ("sharegpt", "grounded"):
        if kind in workloads:
            report[kind] = batch1(engine, texts[kind], args.max_tokens, MODES)
            print(kind, json.dumps(report[kind]["summary"]), flush=True)
    if "batch" in workloads:
        sizes = tuple(int(b) for b in args.batches.split(","))
        report["batches"] = batches(engine, texts["sharegpt"], args.max_tokens, sizes)
    if "load" in workloads:
        report["load"] = load(engine, args.concurrency, args.load_requests, args.max_tokens, args.seed)
    report["costs"] = dataclasses.asdict(engine.speculator.policy.costs)
    (out / "speculative.json").write_text(json.dumps(report, indent=1))
    print(
        json.dumps(
            {k: v.get("summary", v) if isinstance(v, dict) else v for k, v in report.items()}, indent=1
        )
    )


if __name__ == "__main__":
    main()
