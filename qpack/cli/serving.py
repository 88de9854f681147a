"""`qpack serve`: options -> `serve.server.run_server`, which runs until a signal drains it."""

from __future__ import annotations

import typer

from qpack.cli import options as opt
from qpack.cli.app import app, output, run


@app.command(help="Serve an artifact with continuous batching over a paged KV cache (OpenAI API).")
def serve(
    ctx: typer.Context,
    target: opt.ServeTarget = None,
    host: opt.Host = "127.0.0.1",
    port: opt.Port = 8000,
    kv_memory: opt.KVMemory = "512MB",
    block_size: opt.BlockSize = 8,
    kv_dtype: opt.KVDtype = "float32",
    max_num_batched_tokens: opt.MaxBatchedTokens = 1024,
    max_num_seqs: opt.MaxSeqs = 32,
    max_queue: opt.MaxQueue = 256,
    max_model_len: opt.MaxModelLen = None,
    request_timeout: opt.RequestTimeout = 600.0,
    api_key: opt.ApiKeys = [],  # noqa: B006 - typer copies list defaults
    api_key_file: opt.ApiKeyFile = None,
    max_request_bytes: opt.MaxRequestBytes = 4 * 2**20,
    dtype: opt.Dtype = "float32",
    prefix_caching: opt.PrefixCaching = True,
    kv_host_memory: opt.KVHostMemory = "0",
    kv_disk: opt.KVDisk = None,
    kv_disk_size: opt.KVDiskSize = "10GB",
    kv_codec: opt.KVCodec = "zstd",
    session_ttl: opt.SessionTTL = None,
    isolate_users: opt.IsolateUsers = False,
    compile_decode: opt.Compile = False,
    batch_invariant: opt.BatchInvariant = False,
    prefill_dtype: opt.PrefillDtype = "float32",
    redis: opt.Redis = None,
    role: opt.Role = "single",
    workers: opt.Workers = 2,
    claim_idle: opt.ClaimIdle = 10.0,
    threads: opt.Threads = None,
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
        batch_invariant=batch_invariant,
        prefill_dtype=prefill_dtype,
        kv_host_memory=kv_host_memory,
        kv_disk=kv_disk,
        kv_disk_size=kv_disk_size,
        kv_codec=kv_codec,
        session_ttl=session_ttl,
        isolate_users=isolate_users,
        redis=redis,
        role=role,
        workers=workers,
        claim_idle=claim_idle,
        threads=threads,
    )
    log = (lambda _m: None) if out.quiet else (lambda m: out.stderr.print(m, highlight=False, markup=False))
    run(out, lambda: run_server(options, log, out.warn))
