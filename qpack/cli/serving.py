"""`qpack serve`: options (built from `serve.options.ServeOptions`) -> `serve.launch.run_server`, which runs until
a signal drains it."""

from __future__ import annotations

from typing import Any, Optional

import typer

from qpack.cli.app import app, output, run
from qpack.cli.fields import Option, Options
from quantize.common.config import Problems
from serve.options import ServeOptions


def _targets(values: dict[str, Any], problems: Problems) -> dict[str, Any]:
    """`qpack serve A B ...`: the first is `target`, the others its `variants`."""
    del problems
    targets = list(values.get("targets") or [])
    return {"target": targets[0] if targets else None, "variants": tuple(targets[1:])}


SERVE = Options(
    ServeOptions,
    [
        Option(
            "",
            name="targets",
            argument=True,
            cli_type=Optional[list[str]],  # noqa: UP045 - typer reads the annotation at run time
            default=None,
            help="Artifact directories (or a model) to serve; several: variants of one model, most accurate "
            "first by their measured KL (`qpack serve int8/ int4/`).",
        ),
        "model_name",
        "host",
        "port",
        "kv_memory",
        "block_size",
        "kv_dtype",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_queue",
        "prefill_chunk",
        "admission_wait",
        Option("control", ("--control/--no-control",)),
        "control_capacity",
        "max_model_len",
        "request_timeout",
        Option("api_keys", ("--api-key",), envvar="QPACK_API_KEY"),
        "api_key_file",
        Option("metrics_key", ("--metrics-key",), envvar="QPACK_METRICS_KEY"),
        Option("tenants_file", ("--tenants",)),
        "max_request_bytes",
        "dtype",
        Option("prefix_caching", ("--prefix-caching/--no-prefix-caching",)),
        "kv_host_memory",
        "kv_disk",
        "kv_disk_size",
        "kv_codec",
        "session_ttl",
        "isolate_users",
        "compile",
        "batch_invariant",
        "prefill_dtype",
        "speculative",
        "draft",
        "speculative_k",
        "speculative_max_batch",
        "draft_kv_memory",
        Option("redis", ("--redis",), envvar="QPACK_REDIS_URL"),
        "role",
        "workers",
        "worker_variants",
        "claim_idle",
        "threads",
    ],
    "serve",
    build=_targets,
    names={"target": "TARGETS", "variants": "TARGETS"},
)


@app.command(help="Serve an artifact with continuous batching over a paged KV cache (OpenAI API).")
@SERVE.command
def serve(ctx: typer.Context, **values: Any) -> None:
    from serve.launch import run_server

    out = output(ctx)
    options = run(out, lambda: SERVE.config(values))
    log = (
        (lambda _m: None)
        if out.quiet
        else (lambda m: out.stderr.print(m, highlight=False, markup=False, soft_wrap=True))
    )
    run(out, lambda: SERVE.translated(lambda: run_server(options, log, lambda m: out.warn(SERVE.mention(m)))))
