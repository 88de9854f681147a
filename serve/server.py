"""`qpack serve`: load an artifact (or a plain model), size the KV pool, and run the HTTP server.

Binds 127.0.0.1 unless told otherwise. SIGTERM (or Ctrl-C) starts a drain: health turns 503, new requests are
refused, running requests finish and stream to the end, then the process exits.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.common.errors import QpackError
from quantize.common.sizes import parse_size
from quantize.runtime.modules import PREFILL_DTYPES
from serve.engine import Engine, EngineConfig
from serve.kv_cache import KV_DTYPES
from serve.openai import ServerInfo, create_app
from serve.openai.routes import DEFAULT_MAX_REQUEST_BYTES
from serve.tiers.codec import CODECS


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    name: str
    version: str
    source: str
    content_hash: str = ""  # what stored KV blocks are keyed by: a new version never reads old blocks


def load_for_serving(target: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """An artifact directory (quantized modules) or any `--model` spec (FP32/BF16, for comparison)."""
    from quantize.model.sources import load_model, load_tokenizer, resolve_model, weights_sha256

    path = Path(target).expanduser()
    if (path / "manifest.json").is_file():
        from quantize.io.artifact import content_sha256, load_artifact

        loaded = load_artifact(path, device=device, skeleton=True)
        tokenizer = load_tokenizer(path, loaded.manifest.get("tokenizer_class"))
        content = content_sha256(loaded.manifest)
        return LoadedModel(loaded.model, tokenizer, loaded.name, loaded.version, str(loaded.path), content)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise QpackError(f"--dtype must be one of {', '.join(dtypes)} (got {dtype!r})")
    source = resolve_model(target)
    model = load_model(source, dtype=dtypes[dtype], device=device)
    name = source.model_id.rsplit("/", 1)[-1]
    return LoadedModel(
        model, load_tokenizer(source), name, dtype, source.model_id, weights_sha256(source) + dtype
    )


def build_engine(loaded: LoadedModel, config: EngineConfig) -> Engine:
    """The engine, with the heap trimmed after it is built (fusing q/k/v and gate/up frees the unfused copies)."""
    from quantize.common.memory import trim_heap

    config = dataclasses.replace(config, model_hash=config.model_hash or loaded.content_hash)
    try:
        engine = Engine(loaded.model, loaded.tokenizer, config)
    except ValueError as exc:
        raise QpackError(str(exc)) from None
    trim_heap()
    return engine


def describe(engine: Engine) -> str:
    from quantize.runtime.kernels import ops as kernels

    tokens = engine.num_blocks * engine.config.block_size
    decode_kernels = (
        f"native ({(kernels.isa() or '').upper().replace('AVX512', 'AVX-512 VNNI')})"
        if kernels.ready()
        else f"torch ({kernels.unavailable_reason() or 'not built'})"
    )
    config = engine.config
    tiers = []
    if config.kv_host_memory:
        tiers.append(f"host memory {config.kv_host_memory / 2**20:.0f} MiB")
    if config.kv_disk:
        tiers.append(f"disk {config.kv_disk} ({config.kv_disk_size / 2**30:.1f} GiB)")
    return (
        f"KV cache: {engine.num_blocks:,} blocks x {config.block_size} tokens = {tokens:,} tokens "
        f"({engine.kv_bytes / 2**20:.0f} MiB {str(config.kv_dtype).removeprefix('torch.')}, "
        f"{engine.kv_bytes_per_token / 1024:.1f} KiB/token); "
        f"max context {engine.max_model_len:,} tokens; decode kernels: {decode_kernels}"
        + (
            f"; stored KV for returning conversations: {', '.join(tiers)} ({config.kv_codec})"
            if tiers
            else ""
        )
    )


LOOPBACK = ("127.0.0.1", "localhost", "::1")
ROLES = ("single", "gateway", "worker", "all")


def _is_size(text: str) -> bool:
    try:
        parse_size(text, "size")
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ServeOptions:
    """What `qpack serve` was asked for: the model, the address, and the engine's limits."""

    target: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    kv_memory: str = "512MB"
    block_size: int = 8
    kv_dtype: str = "float32"
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    max_queue: int = 256
    max_model_len: int | None = None
    request_timeout: float = 600.0
    api_keys: tuple[str, ...] = ()
    api_key_file: Path | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    dtype: str = "float32"
    prefix_caching: bool = True
    compile: bool = False
    batch_invariant: bool = False
    prefill_dtype: str = "float32"
    kv_host_memory: str = "0"
    kv_disk: str | None = None
    kv_disk_size: str = "10GB"
    kv_codec: str = "zstd"
    session_ttl: float | None = None
    isolate_users: bool = False
    redis: str | None = None
    role: str = "single"
    workers: int = 2
    claim_idle: float = 10.0
    threads: int | None = None

    def worker_args(self) -> list[str]:
        """The options a `--role all` gateway hands on to the workers it starts."""
        args = [
            "--kv-memory",
            str(self.kv_memory),
            "--block-size",
            str(self.block_size),
            "--kv-dtype",
            self.kv_dtype,
        ]
        args += [
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-num-seqs",
            str(self.max_num_seqs),
        ]
        args += [
            "--max-queue",
            str(self.max_queue),
            "--claim-idle",
            str(self.claim_idle),
            "--dtype",
            self.dtype,
            "--prefill-dtype",
            self.prefill_dtype,
        ]
        args += [
            "--kv-host-memory",
            self.kv_host_memory,
            "--kv-disk-size",
            self.kv_disk_size,
            "--kv-codec",
            self.kv_codec,
        ]
        if self.kv_disk:
            args += ["--kv-disk", self.kv_disk]
        if self.batch_invariant:
            args.append("--batch-invariant")
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        return args

    def validate(self) -> None:
        """Every bad option at once, before anything is loaded."""
        checks = (
            (self.block_size >= 1, "--block-size must be at least 1"),
            (self.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be at least 1"),
            (self.max_num_seqs >= 1, "--max-num-seqs must be at least 1"),
            (self.max_queue >= 0, "--max-queue must be >= 0"),
            (self.request_timeout > 0, "--request-timeout must be > 0"),
            (1 <= self.port <= 65535, "--port must be 1..65535"),
            (self.max_request_bytes >= 1024, "--max-request-bytes must be at least 1024"),
            (
                all(key.strip() == key and key for key in self.api_keys),
                "--api-key must not be empty or padded",
            ),
            (
                self.kv_dtype in KV_DTYPES,
                f"--kv-dtype must be one of {', '.join(KV_DTYPES)} (got {self.kv_dtype!r})",
            ),
            (
                self.kv_codec in CODECS,
                f"--kv-codec must be one of {', '.join(CODECS)} (got {self.kv_codec!r})",
            ),
            (self.session_ttl is None or self.session_ttl > 0, "--session-ttl must be > 0 seconds"),
            (
                self.prefill_dtype in PREFILL_DTYPES,
                f"--prefill-dtype must be one of {', '.join(PREFILL_DTYPES)} (got {self.prefill_dtype!r})",
            ),
            (
                _is_size(self.kv_host_memory),
                f"--kv-host-memory {self.kv_host_memory!r} is not a size (e.g. 2GB)",
            ),
            (_is_size(self.kv_disk_size), f"--kv-disk-size {self.kv_disk_size!r} is not a size (e.g. 50GB)"),
            (self.role in ROLES, f"--role must be one of {', '.join(ROLES)} (got {self.role!r})"),
            (self.role == "single" or bool(self.redis), f"--role {self.role} needs --redis URL"),
            (self.role != "single" or not self.redis, "--redis needs --role gateway, worker or all"),
            (
                self.role == "gateway" or bool(self.target),
                "an artifact or model to serve is required (qpack serve ART)",
            ),
            (self.workers >= 1, "--workers must be at least 1"),
            (self.threads is None or self.threads >= 1, "--threads must be at least 1"),
            (self.claim_idle > 0, "--claim-idle must be > 0 seconds"),
        )
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise QpackError("invalid serve options: " + "; ".join(problems))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size,
            kv_memory=self.kv_memory,
            kv_dtype=KV_DTYPES[self.kv_dtype],
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_queue=self.max_queue,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.prefix_caching,
            compile=self.compile,
            batch_invariant=self.batch_invariant,
            prefill_dtype=self.prefill_dtype,
            kv_host_memory=parse_size(self.kv_host_memory, "--kv-host-memory"),
            kv_disk=self.kv_disk,
            kv_disk_size=parse_size(self.kv_disk_size, "--kv-disk-size"),
            kv_codec=self.kv_codec,
            session_ttl=self.session_ttl,
            isolate_users=self.isolate_users,
        )

    def keys(self) -> tuple[str, ...]:
        """--api-key values and the lines of --api-key-file (blank lines and # comments skipped)."""
        keys = list(self.api_keys)
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).expanduser().read_text().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise QpackError(
                    f"--api-key-file {self.api_key_file} cannot be read ({exc}); fix the path"
                ) from None
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if len(keys) == len(self.api_keys):
                raise QpackError(f"--api-key-file {self.api_key_file} holds no key; one key per line")
        return tuple(keys)


def run_server(
    options: ServeOptions, log: Callable[[str], None], warn: Callable[[str], None] = lambda _m: None
) -> None:
    """Validate, then run the role: a single server (the default), a fleet gateway (no model), a fleet worker,
    or a gateway with `--workers` workers beside it. Progress goes to `log`, risks to `warn`; keys never."""
    options.validate()
    keys = options.keys()
    if options.threads:
        torch.set_num_threads(options.threads)
    info = ServerInfo("fleet", "", keys, options.request_timeout, options.max_request_bytes)
    if options.host not in LOOPBACK and not keys:
        warn(f"binding {options.host} without --api-key: anyone who can reach this port can use the model")
    if keys:
        log(f"API keys required: {len(keys)} accepted")
    if options.role in ("gateway", "all"):
        from serve.fleet.run import run_all, run_gateway

        (run_gateway if options.role == "gateway" else run_all)(options, info, log)
        return
    if options.role == "worker":
        from serve.fleet.run import check_redis

        check_redis(options.redis or "")
    loaded, engine = _start_engine(options, log)
    if options.role == "worker":
        from serve.fleet.run import run_worker

        run_worker(options, engine, loaded, log)
        return
    log(f"listening on http://{options.host}:{options.port} (OpenAI API under /v1; /health, /metrics)")
    info = ServerInfo(
        loaded.name,
        loaded.version,
        keys,
        options.request_timeout,
        options.max_request_bytes,
        engine.numerics(),
    )
    serve_forever(engine, info, options.host, options.port)


def _start_engine(options: ServeOptions, log: Callable[[str], None]) -> tuple[LoadedModel, Engine]:
    loaded = load_for_serving(options.target or "", options.dtype)
    log("loading the native decode kernels (built once per machine: ~1 min the first time)...")
    engine = build_engine(loaded, options.engine_config())
    if options.compile:
        log("compiling the decode step (torch.compile)...")
        engine.warmup()
    log(f"qpack serve {loaded.name} v{loaded.version} ({loaded.source})")
    log(describe(engine))
    return loaded, engine


class _DrainingServer:
    """uvicorn.Server that flips the app into draining mode the moment a shutdown signal arrives."""

    def __init__(self, app: Any, host: str, port: int, log_level: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                # Drain instead of re-raising the signal after shutdown: a completed drain exits 0.
                app.state.start_draining()
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True

        self.server = Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=600)
        )

    def run(self) -> None:
        self.server.run()


def serve_forever(
    engine: Engine, info: ServerInfo, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
) -> None:
    serve_app(create_app(engine, info), host, port, log_level)


def serve_app(app: Any, host: str, port: int, log_level: str = "warning") -> None:
    """Run an app (needs `app.state.start_draining`) until a signal drains it."""
    _DrainingServer(app, host, port, log_level).run()


def worker_app(engine: Engine, worker: Any) -> Any:
    """A fleet worker's own HTTP face: `/health` and `/metrics` (the engine's, plus claims)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="qpack fleet worker")
    app.state.start_draining = lambda: None

    @app.get("/health")
    async def health() -> Response:
        load = {"running": len(engine.scheduler.running), "waiting": engine.scheduler.num_waiting}
        return JSONResponse({"status": "ok", "worker": worker.config.worker_id, **load})

    @app.get("/metrics")
    async def metrics() -> Response:
        claims = f"# TYPE qpack_fleet_claims_total counter\nqpack_fleet_claims_total {worker.claimed}\n"
        return Response(engine.metrics.render() + claims.encode(), media_type="text/plain; version=0.0.4")

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BackgroundServer:
    """A server on a thread (tests, benchmarks, a fleet worker's /metrics): `with BackgroundServer(engine, info)
    as url: ...`, or any app: `BackgroundServer(app)`."""

    def __init__(
        self, app: Any, info: ServerInfo | None = None, port: int | None = None, host: str = "127.0.0.1"
    ) -> None:
        import uvicorn

        self.app = create_app(app, info) if isinstance(app, Engine) and info is not None else app
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.app.state.start_draining()
        self.server.should_exit = True
        self.thread.join(timeout=60)
