"""`qpack serve`: options -> `serve.server.run_server`, which runs until a signal drains it."""

from __future__ import annotations

from pathlib import Path

import typer

from qpack.cli.app import app, output, run


@app.command(help="Serve an artifact with continuous batching over a paged KV cache (OpenAI API).")
def serve(
    ctx: typer.Context,
    target: str = typer.Argument(
        ..., help="Artifact directory, or a model (HF folder, .gguf, Hub id, alias)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default loopback only)."),
    port: int = typer.Option(8000, "--port", help="Port."),
    kv_memory: str = typer.Option(
        "512MB", "--kv-memory", help="KV pool size: bytes (512MB, 2GiB) or a fraction of free memory."
    ),
    block_size: int = typer.Option(
        8, "--block-size", help="Tokens per KV block (smaller: less of the pool left unfilled)."
    ),
    kv_dtype: str = typer.Option(
        "float32", "--kv-dtype", help="KV pool element type: float32, bfloat16 (half the memory) or float16."
    ),
    max_num_batched_tokens: int = typer.Option(
        1024, "--max-num-batched-tokens", help="Token budget per step."
    ),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", help="Sequences per batch."),
    max_queue: int = typer.Option(256, "--max-queue", help="Waiting requests before 429."),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Context limit (default: the model's)."
    ),
    request_timeout: float = typer.Option(
        600.0, "--request-timeout", help="Seconds before a request is aborted."
    ),
    api_key: list[str] = typer.Option(
        [],
        "--api-key",
        envvar="QPACK_API_KEY",
        help="Require 'Authorization: Bearer KEY' (repeatable: any listed key is accepted).",
    ),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", help="File of accepted API keys, one per line (# comments)."
    ),
    max_request_bytes: int = typer.Option(
        4 * 2**20, "--max-request-bytes", help="Largest request body; bigger ones get 413 before parsing."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="For plain models: float32, bfloat16 or float16."),
    prefix_caching: bool = typer.Option(
        True, "--prefix-caching/--no-prefix-caching", help="Share cached prompt prefixes."
    ),
    compile_decode: bool = typer.Option(
        False,
        "--compile",
        help="torch.compile the decode steps the fused native step doesn't cover (over 16 sequences, layers "
        "it can't run, no native kernels); minutes of warm-up at start.",
    ),
) -> None:
    from serve.server import ServeOptions, run_server

    out = output(ctx)
    options = ServeOptions(
        target=target,
        host=host,
        port=port,
        kv_memory=kv_memory,
        block_size=block_size,
        kv_dtype=kv_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_queue=max_queue,
        max_model_len=max_model_len,
        request_timeout=request_timeout,
        api_keys=tuple(api_key),
        api_key_file=api_key_file,
        max_request_bytes=max_request_bytes,
        dtype=dtype,
        prefix_caching=prefix_caching,
        compile=compile_decode,
    )
    log = (lambda _m: None) if out.quiet else (lambda m: out.stderr.print(m, highlight=False, markup=False))
    run(out, lambda: run_server(options, log, out.warn))
