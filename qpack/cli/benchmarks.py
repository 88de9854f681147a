"""`qpack bench decode` and `qpack bench serve`: options (built from `qpack.bench.config`) -> `qpack.bench` -> tables
and a results folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from qpack.bench.config import DecodeConfig, ServeBenchConfig
from qpack.cli.app import bench_app, ints, output, run
from qpack.cli.fields import Option, Options
from qpack.cli.render import decode_tables

_OUT = Option(
    "",
    ("--out",),
    Path | None,
    None,
    help="Results folder (default bench-results/KIND-TIME).",
    name="out_dir",
)

DECODE = Options(
    DecodeConfig,
    [
        Option("artifact", argument=True),
        "reference",
        Option("batches", ("--batches",), str, "1,4,16,32", lambda text: ints(text, "--batches")),
        "prompt_tokens",
        "new_tokens",
        "repeats",
        "compile",
        "prefill_dtype",
        "speculative",
        "draft",
        _OUT,
    ],
    "bench decode",
)

SERVE = Options(
    ServeBenchConfig,
    [
        Option("artifact", argument=True, default=None),
        "url",
        "baseline",
        "baseline_model",
        Option(
            "levels",
            ("--concurrency",),
            str,
            "10,30,50",
            lambda text: ints(text, "--concurrency") if text else (),
        ),
        Option("rates", ("--rate",)),
        Option("requests_per_level", ("--requests",)),
        "max_output_tokens",
        "max_prompt_tokens",
        "max_seconds",
        "abort_fraction",
        "kv_memory",
        Option("extra_server_args", ("--server-arg",)),
        "seed",
        "prefill_dtype",
        _OUT,
    ],
    "bench serve",
)


@bench_app.command("decode", help="Prefill/decode tokens/s and peak RSS of an artifact vs FP32 HF generate.")
@DECODE.command
def bench_decode(ctx: typer.Context, **values: Any) -> None:
    from qpack import bench

    out = output(ctx)
    config = run(out, lambda: DECODE.config(values))
    result, folder = run(
        out, lambda: DECODE.translated(lambda: bench.bench_decode(config, values["out_dir"]))
    )
    out.result({**result, "folder": str(folder)}, *decode_tables(result, folder))


@bench_app.command(
    "serve", help="Replay ShareGPT traffic against qpack serve and a naive HF server, same run."
)
@SERVE.command
def bench_serve(ctx: typer.Context, **values: Any) -> None:
    from rich.markdown import Markdown

    from qpack import bench
    from qpack.bench.report import serve_markdown

    out = output(ctx)
    config = run(out, lambda: SERVE.config(values))
    log = (lambda _m: None) if out.quiet else (lambda m: out.stderr.print(m, highlight=False))
    result, folder = run(
        out, lambda: SERVE.translated(lambda: bench.bench_serve(config, values["out_dir"], log))
    )
    out.result({**result, "folder": str(folder)}, Markdown(serve_markdown(result)), f"results: {folder}")
