"""`qpack bench decode` and `qpack bench serve`: options -> `qpack.bench` -> tables and a results folder."""

from __future__ import annotations

from pathlib import Path

import typer

from qpack.cli import options as opt
from qpack.cli.app import bench_app, ints, output, run
from qpack.cli.render import decode_tables


@bench_app.command("decode", help="Prefill/decode tokens/s and peak RSS of an artifact vs FP32 HF generate.")
def bench_decode(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    reference: str | None = typer.Option(
        None, "--reference", help="Reference model (default: the artifact's source)."
    ),
    batches: str = typer.Option("1,4,16,32", "--batches", help="Batch sizes."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Prompt length."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens generated per sequence."),
    repeats: int = typer.Option(3, "--repeats", help="Alternating runs per batch size (median reported)."),
    compile_decode: bool = typer.Option(
        False,
        "--compile",
        help="Run the artifact with its torch.compile'd decode step (as `serve --compile`).",
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Results folder (default bench-results/decode-TIME)."
    ),
    prefill_dtype: opt.PrefillDtype = "float32",
) -> None:
    from qpack import bench

    out = output(ctx)

    def call() -> tuple[dict, Path]:
        sizes = ints(batches, "--batches")
        config = bench.DecodeConfig(
            artifact,
            reference,
            sizes,
            prompt_tokens,
            new_tokens,
            repeats,
            compile=compile_decode,
            prefill_dtype=prefill_dtype,
        )
        return bench.bench_decode(config, out_dir)

    result, folder = run(out, call)
    out.result({**result, "folder": str(folder)}, *decode_tables(result, folder))


@bench_app.command(
    "serve", help="Replay ShareGPT traffic against qpack serve and a naive HF server, same run."
)
def bench_serve(
    ctx: typer.Context,
    artifact: Path | None = typer.Argument(None, help="Artifact to serve (omit with --url)."),
    url: str | None = typer.Option(None, "--url", help="Benchmark an already running server instead."),
    baseline: str = typer.Option(
        "naive", "--baseline", help="naive (HF generate, one at a time, FP32) or none."
    ),
    baseline_model: str | None = typer.Option(None, "--baseline-model", help="Model for the naive baseline."),
    concurrency: str = typer.Option("10,30,50", "--concurrency", help="Concurrency levels."),
    rate: list[float] = typer.Option(
        [], "--rate", help="Poisson arrival rates (req/s), instead of or besides levels."
    ),
    requests: int | None = typer.Option(None, "--requests", help="Requests per level (default: the level)."),
    max_output_tokens: int = typer.Option(
        128, "--max-output-tokens", help="Cap on output tokens per request."
    ),
    max_prompt_tokens: int = typer.Option(512, "--max-prompt-tokens", help="Skip longer prompts."),
    max_seconds: float = typer.Option(900.0, "--max-seconds", help="Time limit per level and server."),
    abort_fraction: float = typer.Option(
        0.0, "--abort-fraction", help="Share of requests the client aborts mid-stream."
    ),
    kv_memory: str = typer.Option("512MB", "--kv-memory", help="KV pool of the qpack server."),
    server_arg: list[str] = typer.Option(
        [], "--server-arg", help="Extra `qpack serve` option, repeatable (--server-arg=--kv-dtype=bfloat16)."
    ),
    seed: int = typer.Option(0, "--seed", help="Request sampling seed."),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Results folder (default bench-results/serve-TIME)."
    ),
    prefill_dtype: opt.PrefillDtype = "float32",
) -> None:
    from rich.markdown import Markdown

    from qpack import bench
    from qpack.bench.report import serve_markdown

    out = output(ctx)

    def call() -> tuple[dict, Path]:
        config = bench.ServeBenchConfig(
            artifact=artifact,
            url=url,
            baseline=baseline,
            baseline_model=baseline_model,
            levels=ints(concurrency, "--concurrency") if concurrency else (),
            rates=tuple(rate),
            requests_per_level=requests,
            max_prompt_tokens=max_prompt_tokens,
            max_output_tokens=max_output_tokens,
            max_seconds=max_seconds,
            abort_fraction=abort_fraction,
            seed=seed,
            kv_memory=kv_memory,
            prefill_dtype=prefill_dtype,
            extra_server_args=tuple(server_arg),
        )
        log = (lambda _m: None) if out.quiet else (lambda m: out.stderr.print(m, highlight=False))
        return bench.bench_serve(config, out_dir, log)

    result, folder = run(out, call)
    out.result({**result, "folder": str(folder)}, Markdown(serve_markdown(result)), f"results: {folder}")
