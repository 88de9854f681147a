"""Returning conversations: multi-turn ShareGPT replay against `qpack serve` with and without KV offload.

Sessions are real ShareGPT conversations with at least `--turns` user turns. Turn t of a session is sent as the
whole conversation so far plus the next user message, as a chat client does: ShareGPT's user messages and the
server's own earlier replies (`--replies sharegpt` sends ShareGPT's assistant messages instead: text the
server never computed, so every turn recomputes the previous answer), through the chat endpoint, greedy, `--max-tokens` tokens, streamed so time to first token is measured. `--sessions`
sessions are interleaved at `--concurrency` with `--think` seconds between a session's turns, against a pool
too small to keep them (`--kv-memory`), so without tiers every turn recomputes its history.

Runs, same requests each time, one server process each:
1. `none`: no tiers (the baseline).
2. `host`: T1 host memory (`--kv-host-memory`), and T2 on disk (`--kv-disk`).
3. `restart`: a new server on the same T2 directory (T1 empty): the last turn of every session again. Each
   request's `usage.prompt_tokens_details.cached_tokens` says how much of its prompt was not recomputed; its
   history is the full blocks its prompt shares with the session's previous turn (what earlier turns wrote), so
   the share of history blocks loaded counts min(cached, history) per request, never the new turn's own blocks.
4. `corrupt`: `restart` again, flipping one byte in `--corrupt` of the T2 files once a fifth of the requests
   are done: outputs must not change. Every damaged file is accounted for: read, refused, counted and deleted;
   overwritten by a recomputed block; or never read (still refused by its checksum if it ever is).
5. `bf16-none` / `bf16-host`: the first `--bf16-sessions` sessions on a bfloat16 pool without and with tiers
   (outputs compared with each other: a bf16 pool's greedy text may differ from an FP32 pool's).
Then `store`: 10,000 synthetic sessions written through T1 and T2 directly (no model) with T1 and T2 smaller
than what is written (`--store-host-memory`, `--store-disk-size`): RSS growth against T1's size + 10%, disk
against its size.

T1 and T2 are sized to hold every session's history: the replay cycles through all sessions turn by turn, and
under such a cyclic pattern an LRU tier smaller than the working set hits almost never.

Greedy outputs of every run are compared with `none` token for token (as text). `--batch-invariant` serves every
run in that mode (serve/core/runner.py), where reused KV is the same bits as recomputed KV.

    python benchmarks/sessions.py out/perf/int8 --out out/sessions

`--deletes` measures instead what session deletions cost the other requests, in one process (no artifact needed:
the shared stories260k model by default): an engine with T1 and T2 and 100,000 sessions indexed (`--indexed`,
over ten tenants at their default cap), serving a steady load of session requests, first alone, then while
clients send DELETEs (single sessions and whole users) as fast as they are answered. It prints engine step times
(p50/p99) and the event loop's lag (a ticker task on the server's loop, every 5 ms) in both phases, the DELETE
latency, and the CPU they ran on.

    python benchmarks/sessions.py --deletes --out out/sessions-deletes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from serve.engine.config import CacheConfig, OffloadConfig

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 8  # the server's default --block-size


def conversations(count: int, turns: int, max_chars: int, seed: int) -> list[list[dict[str, str]]]:
    """ShareGPT conversations with >= `turns` user turns, each message cut to `max_chars`, in alternating
    user/assistant order, seeded sample."""
    from calibrate.sources import default_queries_path, read_source

    found = []
    for conversation in read_source(default_queries_path()).conversations:
        messages = [
            {"role": m.role, "content": m.content[:max_chars]}
            for m in conversation
            if m.role in ("user", "assistant")
        ]
        alternating = all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(messages))
        if (
            alternating
            and sum(m["role"] == "user" for m in messages) >= turns
            and all(m["content"].strip() for m in messages)
        ):
            found.append(messages[: 2 * turns - 1])
    random.Random(seed).shuffle(found)
    return found[:count]


Replies = dict[tuple[int, int], dict[str, Any]]


def turn_messages(
    messages: list[dict[str, str]], turn: int, session: int, replies: Replies | None
) -> list[dict[str, str]]:
    """The conversation up to user turn `turn`; with `replies`, the assistant turns are the server's own
    earlier answers (what a chat client sends back), else ShareGPT's."""
    shown = [dict(m) for m in messages[: 2 * turn + 1]]
    if replies is not None:
        for earlier in range(turn):
            shown[2 * earlier + 1]["content"] = replies[(session, earlier)]["text"]
    return shown


def turn_request(messages: list[dict[str, str]], session: int, max_tokens: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": f"user-{session % 50}",
        "session_id": f"session-{session}",
    }


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: time to first token, text, finish reason and usage; a transport failure or
    an engine error is returned as `error`, never raised (one bad request must not end the replay)."""
    started = time.perf_counter()
    first = None
    text = []
    usage: dict[str, Any] | None = None
    finish = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}", "ttft": None, "text": ""}
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    delta = chunk["choices"]
                    if delta and delta[0].get("delta", {}).get("content"):
                        first = first or time.perf_counter()
                        text.append(delta[0]["delta"]["content"])
                    if delta and delta[0].get("finish_reason"):
                        finish = delta[0]["finish_reason"]
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "ttft": None, "text": "".join(text)}
    result: dict[str, Any] = {
        "ttft": (first or time.perf_counter()) - started,
        "text": "".join(text),
        "finish_reason": finish,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens") if usage else None,
    }
    if finish == "error" or usage is None:
        result["error"] = "engine error" if finish == "error" else "no usage chunk"
    return result


async def replay(
    url: str,
    sessions: list[list[dict[str, str]]],
    turns: list[int],
    concurrency: int,
    think: float,
    max_tokens: int,
    results: Replies | None = None,
    replies: Replies | str | None = "own",
) -> Replies:
    """Each session's `turns` in order, `think` seconds apart, sessions interleaved at `concurrency`; fills and
    returns `results` (pass one in to watch progress). Earlier assistant turns are this run's own replies
    (`"own"`), an earlier run's (a results dict), or ShareGPT's (None)."""
    results = {} if results is None else results
    earlier = results if replies == "own" else replies
    assert not isinstance(earlier, str)
    gate = asyncio.Semaphore(concurrency)

    async def session(index: int, messages: list[dict[str, str]]) -> None:
        await asyncio.sleep(index * think / max(len(sessions), 1))  # spread the first turns
        for turn in turns:
            shown = turn_messages(messages, turn, index, earlier)
            async with gate:
                results[(index, turn)] = await send(client, url, turn_request(shown, index, max_tokens))
            await asyncio.sleep(think)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(session(i, m) for i, m in enumerate(sessions)))
    return results


class Server:
    def __init__(self, artifact: Path, args: list[str], log: Path) -> None:
        from serve.http import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "qpack", "serve", str(artifact), "--port", str(self.port), *args]
        self.handle = open(log, "a")  # noqa: SIM115 - closed in stop()
        self.handle.write(f"\n$ {' '.join(command)}\n")
        self.handle.flush()
        self.process = subprocess.Popen(command, stdout=self.handle, stderr=self.handle)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server exited {self.process.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit("server did not start")

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=300)
        self.handle.close()


def summarize(results: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    later = [r["ttft"] for (_, turn), r in results.items() if turn >= 1 and r.get("ttft") is not None]
    first = [r["ttft"] for (_, turn), r in results.items() if turn == 0 and r.get("ttft") is not None]
    every = later + first
    return {
        "requests": len(results),
        "errors": sum(1 for r in results.values() if r.get("error")),
        "ttft_p50_turns_ge_2_s": round(statistics.median(later), 3) if later else None,
        "ttft_p50_turn_1_s": round(statistics.median(first), 3) if first else None,
        "ttft_mean_all_turns_s": round(statistics.mean(every), 3) if every else None,
        "ttft_p90_all_turns_s": round(statistics.quantiles(every, n=10)[-1], 3) if len(every) > 1 else None,
    }


def mismatches(a: dict[tuple[int, int], dict[str, Any]], b: dict[tuple[int, int], dict[str, Any]]) -> int:
    return sum(1 for key in b if key in a and a[key]["text"] != b[key]["text"])


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the server builds for these messages (chat template, generation prompt)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def history_tokens(
    sessions: list[list[dict[str, str]]], turn: int, tokenizer: Any, block_size: int, replies: Replies | None
) -> list[int]:
    """Per session: the tokens, in whole blocks, that turn `turn`'s prompt shares with what turn `turn - 1`
    computed (its prompt, and its reply when replies are the server's own): the history earlier turns wrote
    down. The new turn's own blocks are not history."""
    shared = []
    for index, messages in enumerate(sessions):
        now = chat_ids(tokenizer, turn_messages(messages, turn, index, replies))
        before = chat_ids(tokenizer, turn_messages(messages, turn - 1, index, replies))
        if replies is not None:
            reply = replies[(index, turn - 1)]
            ids = tokenizer(reply["text"], add_special_tokens=False)["input_ids"]
            before += ids[:-1] if reply.get("finish_reason") == "length" else ids  # the last one has no KV
        common = next(
            (i for i, (a, b) in enumerate(zip(now, before, strict=False)) if a != b),
            min(len(now), len(before)),
        )
        shared.append(common // block_size * block_size)
    return shared


def history_share(results: dict[tuple[int, int], dict[str, Any]], turn: int, history: list[int]) -> float:
    """Share of the history tokens that were not recomputed (loaded from a tier or found in the pool), over the
    requests that succeeded."""
    answered = [
        (results[(index, turn)]["cached_tokens"], tokens)
        for index, tokens in enumerate(history)
        if (index, turn) in results and "error" not in results[(index, turn)]
    ]
    return round(sum(min(c, t) for c, t in answered) / max(sum(t for _, t in answered), 1), 3)


def store_bound(out: Path, host_bytes: int, disk_bytes: int, sessions: int = 10_000) -> dict[str, Any]:
    """`sessions` sessions of 3 SmolLM2-shaped FP32 blocks (random values: barely compressible, the worst case)
    through the write-through queue into T1 and T2: RSS growth (sampled every 10 ms) and disk use against the
    bounds. Run in a fresh process (`store_bound_fresh`), so no heap freed by earlier work hides growth."""
    import psutil
    import torch

    from serve.engine.builder import write_queue_bytes
    from serve.offload.codec import BlockLayout
    from serve.offload.manager import OffloadManager
    from serve.offload.stores import DiskStore, HostStore

    layout = BlockLayout(b"s" * 32, torch.float32, 8, 30, 3, 64)
    folder = out / "store-t2"
    shutil.rmtree(folder, ignore_errors=True)
    process = psutil.Process()
    blocks = [torch.randn(layout.shape) for _ in range(4)]
    import zstandard  # noqa: F401 - loaded before the baseline

    base = process.memory_info().rss
    peak = 0
    sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not sampling.wait(0.01):
            peak = max(peak, process.memory_info().rss - base)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tiers = OffloadManager(
        layout,
        HostStore(host_bytes),
        DiskStore(folder, disk_bytes),
        queue_bytes=write_queue_bytes(host_bytes),
    )
    retries = 0
    started = time.perf_counter()
    for index in range(sessions):
        for part in range(3):
            key = index.to_bytes(8, "little") + part.to_bytes(8, "little") + b"\0" * 16
            while not tiers.offer(
                key, blocks[(index + part) % 4].clone(), ("default", f"user-{index % 100}", f"s{index}")
            ):
                retries += 1
                time.sleep(0.002)
    tiers.flush()
    sampling.set()
    sampler.join()
    seconds = time.perf_counter() - started
    rss = process.memory_info().rss - base
    peak = max(peak, rss)
    disk = sum(p.stat().st_size for p in folder.glob("??/*.kv"))
    result = {
        "sessions": sessions,
        "blocks_written": tiers.stats.written,
        "seconds": round(seconds, 1),
        "rss_growth_mib": round(rss / 2**20, 1),
        "rss_growth_peak_mib": round(peak / 2**20, 1),
        "host_bound_mib": round(host_bytes * 1.1 / 2**20, 1),
        "host_stored_mib": round(tiers.host.size / 2**20, 1) if tiers.host else 0,
        "disk_mib": round(disk / 2**20, 1),
        "disk_bound_mib": round(disk_bytes / 2**20, 1),
        "sessions_indexed": len(tiers.sessions),
        "queue_blocks": tiers.queue_capacity,
        "queue_full_retries": retries,
    }
    tiers.close()
    shutil.rmtree(folder, ignore_errors=True)
    return result


def store_bound_fresh(out: Path, host_bytes: int, disk_bytes: int, sessions: int) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(store_bound, (out, host_bytes, disk_bytes, sessions))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifact", type=Path, nargs="?", help="(not needed with --deletes)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "sessions")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--think", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-chars", type=int, default=400)
    parser.add_argument("--kv-memory", default="64MB")
    parser.add_argument("--kv-host-memory", default="8GB", help="T1: room for every session's history")
    parser.add_argument("--kv-disk-size", default="16GB")
    parser.add_argument("--corrupt", type=float, default=0.05)
    parser.add_argument(
        "--bf16-sessions", type=int, default=50, help="sessions of the bf16 pool runs (0: skip)"
    )
    parser.add_argument(
        "--replies",
        choices=("own", "sharegpt"),
        default="own",
        help="earlier assistant turns: the server's own replies (a chat client) or ShareGPT's",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="serve every run with --batch-invariant (outputs independent of reuse and batching)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the servers' step budget")
    parser.add_argument("--no-restart", action="store_true", help="skip the restart and corruption runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-sessions", type=int, default=10_000)
    parser.add_argument(
        "--store-host-memory", default="2GB", help="T1 of the store run (its blocks overflow it)"
    )
    parser.add_argument("--store-disk-size", default="4GB")
    parser.add_argument("--deletes", action="store_true", help="measure what DELETEs cost (see above)")
    parser.add_argument("--indexed", type=int, default=100_000, help="sessions indexed for --deletes")
    parser.add_argument("--phase-seconds", type=float, default=25.0, help="each --deletes phase")
    args = parser.parse_args()
    if args.artifact is None and not args.deletes:
        parser.error("give the artifact to replay against (or --deletes)")
    if args.turns < 2:
        parser.error("--turns must be at least 2 (returning turns are what is measured)")
    return args


def main() -> None:
    args = _arguments()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.deletes:
        result = measure_deletes(args.artifact, out, args.indexed, args.phase_seconds)
        (out / "deletes.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return
    log = out / "servers.log"
    sessions = conversations(args.sessions, args.turns, args.max_chars, args.seed)
    turns = list(range(args.turns))
    disk = out / "t2"
    shutil.rmtree(disk, ignore_errors=True)
    base = ["--kv-memory", args.kv_memory, "--max-num-seqs", str(args.concurrency)]
    base += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    base += ["--batch-invariant"] if args.batch_invariant else []
    tiered = [
        *base,
        "--kv-host-memory",
        args.kv_host_memory,
        "--kv-disk",
        str(disk),
        "--kv-disk-size",
        args.kv_disk_size,
    ]
    results: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "sessions": len(sessions),
    }
    runs: dict[str, Any] = {}
    _replay_run("none", args, sessions, turns, base, log, runs, results, None)
    _replay_run("host", args, sessions, turns, tiered, log, runs, results, "none")
    results["host"]["ttft_speedup_turns_ge_2"] = round(
        results["none"]["ttft_p50_turns_ge_2_s"] / results["host"]["ttft_p50_turns_ge_2_s"], 2
    )
    results["host"]["mismatches_vs_none"] = mismatches(runs["none"], runs["host"])
    if not args.no_restart:
        _restart_runs(args, sessions, tiered, disk, log, runs, results)
    if args.bf16_sessions:
        few, bf16 = sessions[: args.bf16_sessions], ["--kv-dtype", "bfloat16"]
        shutil.rmtree(disk, ignore_errors=True)
        _replay_run("bf16-none", args, few, turns, [*base, *bf16], log, runs, results, None)
        _replay_run("bf16-host", args, few, turns, [*tiered, *bf16], log, runs, results, "bf16-none")
        results["bf16-host"]["mismatches_vs_bf16_none"] = mismatches(runs["bf16-none"], runs["bf16-host"])
    shutil.rmtree(disk, ignore_errors=True)
    results["store"] = store_bound_fresh(
        out, _bytes(args.store_host_memory), _bytes(args.store_disk_size), args.store_sessions
    )
    print("store", json.dumps(results["store"]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def _replay_run(
    name: str,
    args: argparse.Namespace,
    sessions: list[Any],
    turns: list[int],
    server_args: list[str],
    log: Path,
    runs: dict[str, Any],
    results: dict[str, Any],
    baseline: str | None,
) -> None:
    """One server, every turn of `sessions`. A baseline run (`baseline` None) sends its own earlier replies;
    the runs compared with it send the baseline's, so both send the same requests and a reply that differs
    counts once, not again in every later turn of its session."""
    server = Server(args.artifact, server_args, log)
    started = time.perf_counter()
    replies: Replies | str | None = None
    if args.replies == "own":
        replies = "own" if baseline is None else runs[baseline]
    runs[name] = asyncio.run(
        replay(server.url, sessions, turns, args.concurrency, args.think, args.max_tokens, replies=replies)
    )
    results[name] = {
        **summarize(runs[name]),
        "seconds": round(time.perf_counter() - started, 1),
        "metrics": _tier_metrics(server.metrics()),
    }
    server.stop()
    print(name, json.dumps(results[name]), flush=True)


def _restart_runs(
    args: argparse.Namespace,
    sessions: list[Any],
    tiered: list[str],
    disk: Path,
    log: Path,
    runs: dict[str, Any],
    results: dict[str, Any],
) -> None:
    """A fresh server on the same disk tier, the last turn of every session; then again, damaging files."""
    from quantize.model.sources import load_tokenizer

    last = args.turns - 1
    replies = runs["none"] if args.replies == "own" else None
    history = history_tokens(sessions, last, load_tokenizer(args.artifact), BLOCK_SIZE, replies)
    for name in ("restart", "corrupt"):
        server = Server(args.artifact, [*tiered, "--kv-host-memory", "0"], log)
        damage: dict[Path, bytes] = {}
        runs[name] = asyncio.run(
            _replay_damaging(server.url, sessions, last, args, disk, damage, name, replies)
        )
        metrics = _tier_metrics(server.metrics())
        server.stop()
        results[name] = {
            **summarize(runs[name]),
            "metrics": metrics,
            "history_tokens": sum(history),
            "history_share_not_recomputed": history_share(runs[name], last, history),
            "mismatches_vs_none": mismatches(runs["none"], runs[name]),
        }
        if name == "corrupt":
            results[name]["damaged_files"] = _damage_fate(damage, disk)
        print(name, json.dumps(results[name]), flush=True)


async def _replay_damaging(
    url: str,
    sessions: list[Any],
    turn: int,
    args: argparse.Namespace,
    disk: Path,
    damage: dict[Path, bytes],
    name: str,
    replies: Replies | None,
) -> Replies:
    """The replay of one turn; for `corrupt`, flips a byte in `--corrupt` of the T2 files once a fifth of the
    requests are done (recording each damaged file's bytes in `damage`)."""
    results: Replies = {}
    task = asyncio.create_task(
        replay(url, sessions, [turn], args.concurrency, 0.0, args.max_tokens, results, replies)
    )
    if name == "corrupt":
        while not task.done() and len(results) < len(sessions) // 5:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(_damage, disk, args.corrupt, args.seed, damage)
    return await task


def _damage(disk: Path, share: float, seed: int, damage: dict[Path, bytes]) -> None:
    """Flip one byte in `share` of the T2 files (off the event loop: streams keep being read meanwhile)."""
    files = sorted(disk.glob("??/*.kv"))
    for path in random.Random(seed).sample(files, min(len(files), max(1, int(len(files) * share)))):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        damage[path] = bytes(data)


def _damage_fate(damage: dict[Path, bytes], disk: Path) -> dict[str, int]:
    """What became of each damaged file: deleted (read, refused and counted, or evicted), overwritten (read,
    refused and recomputed, or recomputed after an earlier block of its chain was refused), or untouched (never
    read); and how many files in T2 now fail their checksum (must be exactly the untouched ones)."""
    from serve.offload.codec import intact

    fate = {"damaged": len(damage), "deleted": 0, "overwritten": 0, "untouched": 0}
    for path, data in damage.items():
        if not path.exists():
            fate["deleted"] += 1
        elif path.read_bytes() != data:
            fate["overwritten"] += 1
        else:
            fate["untouched"] += 1
    fate["failing_checksum_after"] = sum(not intact(p.read_bytes()) for p in disk.glob("??/*.kv"))
    return fate


def _tier_metrics(values: dict[str, float]) -> dict[str, float]:
    picks = {
        "hits_host": 'qpack_kv_offload_hits_total{store="host"}',
        "hits_disk": 'qpack_kv_offload_hits_total{store="disk"}',
        "misses": "qpack_kv_offload_misses_total",
        "dropped": "qpack_kv_offload_dropped_writes_total",
        "corrupt_disk": 'qpack_kv_offload_corrupt_blocks_total{store="disk"}',
        "cached_prompt_tokens": "qpack_prompt_tokens_cached_total",
        "prompt_tokens": "qpack_prompt_tokens_total",
    }
    return {name: values.get(metric, 0.0) for name, metric in picks.items()}


def _bytes(text: str) -> int:
    from quantize.common.sizes import parse_size

    return parse_size(text, "size")


# ---------------------------------------------------------------------- --deletes

DELETE_TENANTS = 10


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """p50, p99 and max of `values` (seconds) in milliseconds."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(ordered),
        "p50_ms": round(pick(0.5) * scale, 3),
        "p99_ms": round(pick(0.99) * scale, 3),
        "max_ms": round(ordered[-1] * scale, 3),
    }


def _cpu() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def _deletes_server(model: Path, out: Path) -> tuple[Any, Any]:
    """An engine with T1 and T2 under `out` and its API with DELETE_TENANTS tenants (keys `key-0`...), plus a
    route that starts the event-loop ticker."""
    from quantize.model.sources import load_model, load_tokenizer, resolve_model
    from serve.engine.config import EngineConfig
    from serve.engine.core import Engine
    from serve.openai import ServerInfo
    from serve.server import create_app
    from serve.tenancy.tenants import TenantsSource

    tenants = out / "tenants.toml"
    tenants.write_text("".join(f'[tenants.t{i}]\nkeys = ["key-{i}"]\n\n' for i in range(DELETE_TENANTS)))
    shutil.rmtree(out / "t2", ignore_errors=True)
    source = resolve_model(str(model))
    config = EngineConfig(
        cache=CacheConfig(memory="64MB"),
        offload=OffloadConfig(host_memory=256 * 2**20, disk=str(out / "t2"), disk_size=1024 * 2**20),
        max_model_len=512,
    )
    engine = Engine(load_model(source), load_tokenizer(source), config)
    info = ServerInfo(name="bench", version="1", tenants=TenantsSource(tenants), request_timeout=120)
    app = create_app(engine, info)
    app.state.lag = []

    @app.get("/bench/ticker")
    async def ticker() -> dict[str, str]:
        async def tick() -> None:
            while True:
                started = time.perf_counter()
                await asyncio.sleep(0.005)
                app.state.lag.append(time.perf_counter() - started - 0.005)

        app.state.ticking = asyncio.ensure_future(tick())
        return {"status": "ticking"}

    return engine, app


def _index_sessions(engine: Any, count: int) -> None:
    """`count` sessions over the tenants, each holding one block key (not stored: the index is what is
    measured), as if recorded earlier."""
    tiers = engine.offload.manager
    per = count // DELETE_TENANTS
    now = time.time() - 3600
    with tiers._lock:
        for tenant in range(DELETE_TENANTS):
            for i in range(per):
                name = (f"t{tenant}", f"user-{i // 4}", f"s{i}")
                tiers.index.use(name, None, None, now=now + i * 1e-3)
                tiers.index.add_key(name, random.randbytes(32), 100_000)
    tiers.flush()


def _load(url: str, stop: threading.Event, errors: list[str]) -> None:
    """One client: session requests of tenant t0, one after another, each a new session (real blocks)."""
    words = [
        "once",
        "upon",
        "a",
        "time",
        "there",
        "was",
        "a",
        "little",
        "girl",
        "who",
        "liked",
        "to",
        "play",
        "in",
        "the",
        "park",
        "with",
        "her",
        "dog",
    ]
    rng = random.Random(threading.get_ident())
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            prompt = " ".join(rng.choice(words) for _ in range(120))
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            body |= {"user": f"load-{rng.randrange(50)}", "session_id": f"live-{rng.randrange(10**9)}"}
            answer = client.post(
                f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer key-0"}
            )
            if answer.status_code != 200:
                errors.append(f"{answer.status_code} {answer.text[:200]}")


def _delete(url: str, stop: threading.Event, latencies: list[float], codes: dict[int, int]) -> None:
    """One client sending DELETEs back to back: single sessions and whole users, of every tenant."""
    rng = random.Random(threading.get_ident())
    per = 10**9
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            tenant = rng.randrange(DELETE_TENANTS)
            if rng.random() < 0.5:
                i = rng.randrange(per) % 10_000
                path, params = f"/v1/sessions/s{i}", {"user": f"user-{i // 4}"}
            else:
                path, params = "/v1/sessions", {"user": f"user-{rng.randrange(2500)}"}
            started = time.perf_counter()
            answer = client.delete(
                f"{url}{path}", params=params, headers={"Authorization": f"Bearer key-{tenant}"}
            )
            latencies.append(time.perf_counter() - started)
            codes[answer.status_code] = codes.get(answer.status_code, 0) + 1


def _phase(url: str, app: Any, steps: list[float], seconds: float, deleters: int) -> dict[str, Any]:
    """`seconds` of load (4 clients), with `deleters` DELETE clients beside it: step times, loop lag, DELETEs."""
    stop, errors, latencies, codes = threading.Event(), [], [], {}  # type: ignore[var-annotated]
    threads = [threading.Thread(target=_load, args=(url, stop, errors)) for _ in range(4)]
    threads += [threading.Thread(target=_delete, args=(url, stop, latencies, codes)) for _ in range(deleters)]
    for thread in threads:
        thread.start()
    time.sleep(3)  # warm up
    del steps[:], app.state.lag[:]
    time.sleep(seconds)
    measured_steps, lag = list(steps), list(app.state.lag)
    stop.set()
    for thread in threads:
        thread.join()
    return {
        "engine_step": _percentiles(measured_steps),
        "event_loop_lag": _percentiles(lag),
        "deletes": {**_percentiles(latencies), "status": codes},
        "load_errors": errors[:3],
    }


def measure_deletes(model: Path | None, out: Path, indexed: int, seconds: float) -> dict[str, Any]:
    """Engine step times and event-loop lag with `indexed` sessions indexed, without and with DELETEs."""
    from serve.http import BackgroundServer

    model = model or ROOT.parent / "shared" / "models" / "stories260k"
    engine, app = _deletes_server(model, out)
    steps: list[float] = []
    step = engine.step

    def timed() -> bool:
        started = time.perf_counter()
        worked = step()
        if worked:
            steps.append(time.perf_counter() - started)
        return bool(worked)

    engine.step = timed
    started = time.perf_counter()
    _index_sessions(engine, indexed)
    result: dict[str, Any] = {
        "cpu": _cpu(),
        "model": str(model),
        "indexed": len(engine.offload.manager.index),
        "index_seconds": round(time.perf_counter() - started, 1),
    }
    print(f"CPU: {result['cpu']}; {result['indexed']:,} sessions indexed", flush=True)
    with BackgroundServer(app) as url:
        httpx.get(f"{url}/bench/ticker")
        result["without_deletes"] = _phase(url, app, steps, seconds, 0)
        print("without DELETEs", json.dumps(result["without_deletes"]), flush=True)
        result["with_deletes"] = _phase(url, app, steps, seconds, 2)
        print("with DELETEs   ", json.dumps(result["with_deletes"]), flush=True)
    result["indexed_after"] = len(engine.offload.manager.index)
    engine.close()
    return result


if __name__ == "__main__":
    main()
