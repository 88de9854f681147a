"""Benchmark outputs: a results folder with the exact command, machine info, JSON, Markdown tables and PNGs."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any


def results_dir(out: Path | None, kind: str) -> Path:
    folder = out or Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def decode_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### Decode: {result['artifact']['name']} vs {result['reference']['name']}",
        "",
        f"{result['settings']['prompt_tokens']}-token prompts, {result['settings']['new_tokens']} new tokens, "
        f"median of {result['settings']['repeats']} alternating runs.",
        "",
        "| batch | prefill tok/s (artifact / FP32) | decode tok/s (artifact / FP32) | decode ratio | peak RSS MB (artifact / FP32) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        a, r = row["artifact"], row["reference"]
        lines.append(
            f"| {row['batch']} | {_fmt(a['prefill_tokens_per_s'], 0)} / {_fmt(r['prefill_tokens_per_s'], 0)} "
            f"| {_fmt(a['decode_tokens_per_s'])} / {_fmt(r['decode_tokens_per_s'])} | {row['decode_ratio']:.2f}x "
            f"| {_fmt(a['peak_rss_mb'], 0)} / {_fmt(r['peak_rss_mb'], 0)} |"
        )
    bound = result["bound"]
    lines += [
        "",
        f"Memory bound: {bound['artifact_bytes_per_token'] / 1e6:.0f} MB read per token at "
        f"{bound['bandwidth_gbs']:.1f} GB/s measured read bandwidth → ceiling {bound['ceiling_tokens_per_s']:.0f} tok/s; "
        f"batch 1 reaches {100 * (bound['batch1_fraction_of_ceiling'] or 0):.0f}% of it.",
    ]
    profile = result.get("profile_batch1")
    if profile:
        parts = ", ".join(f"{k} {v:.1f} ms" for k, v in profile["breakdown_ms"].items())
        lines += ["", f"Batch-1 decode step {profile['step_ms']:.1f} ms: {parts}."]
    return "\n".join(lines) + "\n"


def serve_markdown(result: dict[str, Any]) -> str:
    lines = [
        "### Serving: qpack vs naive HF `generate` (one request at a time, FP32)",
        "",
        "| level | server | req/s | out tok/s | e2e avg / p50 / p95 / p99 (s) | TTFT p50 (s) | TPOT p50 (ms) | errors | peak RSS MB | peak KV |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in result["levels"]:
        for side in ("artifact", "baseline"):
            if side not in entry:
                continue
            s = entry[side]
            e2e = s["e2e_s"]
            lines.append(
                f"| {entry['level']} | {'qpack' if side == 'artifact' else 'naive'} | {s['requests_per_s']:.2f} | "
                f"{s['output_tokens_per_s']:.1f} | {_fmt(e2e['avg'], 2)} / {_fmt(e2e['p50'], 2)} / {_fmt(e2e['p95'], 2)} / "
                f"{_fmt(e2e['p99'], 2)} | {_fmt(s['ttft_s']['p50'], 2)} | {_fmt(s['tpot_s']['p50'] * 1e3 if s['tpot_s']['p50'] == s['tpot_s']['p50'] else None, 0)} | "
                f"{s['errors']} | {_fmt(s.get('peak_rss_mb'), 0)} | {_fmt(100 * s['peak_kv_usage'] if s.get('peak_kv_usage') is not None else None, 0)}{'%' if s.get('peak_kv_usage') is not None else ''} |"
            )
        if "requests_per_s_ratio" in entry:
            lines.append(
                f"| {entry['level']} | **ratio** | **{entry['requests_per_s_ratio']:.1f}x** | **{entry['tokens_per_s_ratio']:.1f}x** | | | | | | |"
            )
    return "\n".join(lines) + "\n"


def _figure(width: float = 6.0, height: float = 3.5) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=(width, height))


def decode_plots(result: dict[str, Any], folder: Path) -> list[str]:
    plt, (fig, ax) = _figure()
    batches = [r["batch"] for r in result["rows"]]
    for side, label in (("artifact", result["artifact"]["name"]), ("reference", "FP32 HF generate")):
        ax.plot(batches, [r[side]["decode_tokens_per_s"] for r in result["rows"]], marker="o", label=label)
    ax.axhline(
        result["bound"]["ceiling_tokens_per_s"],
        linestyle="--",
        color="gray",
        label="batch-1 memory-bound ceiling",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=7)
    fig.savefig(folder / "decode_throughput.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    plt, (fig, ax) = _figure()
    for side, label in (("artifact", result["artifact"]["name"]), ("reference", "FP32 HF generate")):
        ax.plot(batches, [r[side]["peak_rss_mb"] for r in result["rows"]], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("peak RSS (MB)")
    ax.set_title("memory vs batch size", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(folder / "memory_vs_batch.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return ["decode_throughput.png", "memory_vs_batch.png"]


def serve_plots(result: dict[str, Any], folder: Path) -> list[str]:
    levels = [e for e in result["levels"] if "concurrency" in e]
    if not levels:
        return []
    x = [e["concurrency"] for e in levels]
    names = []
    plt, (fig, ax) = _figure()
    for side, style in (("artifact", "-"), ("baseline", "--")):
        if all(side in e for e in levels):
            for pct in ("p50", "p95", "p99"):
                ax.plot(
                    x,
                    [e[side]["e2e_s"][pct] for e in levels],
                    style,
                    marker="o",
                    label=f"{'qpack' if side == 'artifact' else 'naive'} {pct}",
                )
    ax.set_xlabel("concurrency")
    ax.set_ylabel("end-to-end latency (s)")
    ax.legend(fontsize=7)
    fig.savefig(folder / "latency_vs_concurrency.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    names.append("latency_vs_concurrency.png")
    plt, (fig, ax) = _figure()
    for side in ("artifact", "baseline"):
        if all(side in e for e in levels):
            ax.plot(
                x,
                [e[side]["output_tokens_per_s"] for e in levels],
                marker="o",
                label="qpack" if side == "artifact" else "naive",
            )
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=7)
    fig.savefig(folder / "throughput_vs_concurrency.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    names.append("throughput_vs_concurrency.png")
    plt, (fig, ax) = _figure()
    for side in ("artifact", "baseline"):
        if all(side in e and e[side].get("peak_rss_mb") for e in levels):
            ax.plot(
                x,
                [e[side]["peak_rss_mb"] for e in levels],
                marker="o",
                label="qpack" if side == "artifact" else "naive",
            )
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("peak server RSS (MB)")
    ax.set_title("memory vs batch size", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(folder / "memory_vs_concurrency.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    names.append("memory_vs_concurrency.png")
    return names


def write_results(folder: Path, result: dict[str, Any], markdown: str, plots: list[str]) -> None:
    (folder / "command.txt").write_text(" ".join(shlex.quote(a) for a in sys.argv) + "\n")
    (folder / "results.json").write_text(json.dumps(result, indent=2, default=str))
    images = "".join(f"\n![{name}]({name})\n" for name in plots)
    (folder / "report.md").write_text(markdown + images)
