"""What `qpack serve` was asked for, checked before anything is loaded.

`ServeOptions` is the one description of a server, a fleet gateway or a fleet worker: the CLI builds its options
from these fields and their docstrings (`qpack/cli/serving.py`), `run_server` validates it (every problem at once,
each named by its field), and a `--role all` gateway hands each worker it starts its own options as JSON
(`to_json`, `from_json`), so a worker is configured by the same fields, never by re-spelling them as flags. Plain
data, importable without torch; `serve.loading.engine_config` makes the engine's config from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from quantize.common.config import Problems
from quantize.common.errors import QpackError
from quantize.common.sizes import parse_size
from quantize.runtime.precision import DEFAULT_PREFILL_DTYPE, PREFILL_DTYPE_NAMES
from serve.core.config import SchedulerConfig
from serve.engine.config import CacheConfig, OffloadConfig, SpeculationConfig
from serve.kv_formats import CODECS, KV_DTYPE_NAMES

# the engine's settings are declared in its configs; an option's default is theirs
_SCHEDULER, _CACHE, _OFFLOAD, _SPECULATION = (
    SchedulerConfig(),
    CacheConfig(),
    OffloadConfig(),
    SpeculationConfig(),
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ROLES = ("single", "gateway", "worker", "all")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")  # serve/speculative/policy.py's MODES
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


def redacted(url: str) -> str:
    """`url` as logs may show it: a password in it (redis://:PASSWORD@host:6379/0) becomes ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _is_size(text: str) -> bool:
    try:
        parse_size(text, "size")
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ServeOptions:
    """What `qpack serve` was asked for: the model, the address, the engine's limits, the fleet role."""

    target: str | None
    """Artifact directory, or a model (HF folder, .gguf, Hub id, alias); not needed by the gateway role."""
    variants: tuple[str, ...] = ()
    """More artifacts of the same model (`qpack serve A B`: its int4 variant beside the int8 one), each with its own
    engine and KV pool; with `control`, lower tiers move to the cheaper one under load."""
    model_name: str | None = None
    """The name this server or worker answers to (default: the artifact's, or with `variants` the name of the
    model they were built from)."""
    host: str = "127.0.0.1"
    """Address to bind (default loopback only)."""
    port: int = 8000
    """Port."""
    kv_memory: str = str(_CACHE.memory)
    """KV pool size: bytes (512MB, 2GiB) or a fraction of free memory."""
    block_size: int = _CACHE.block_size
    """Tokens per KV block (smaller: less of the pool left unfilled)."""
    kv_dtype: str = _CACHE.dtype
    """KV pool element type: float32, bfloat16 (half the memory) or float16."""
    max_num_batched_tokens: int = _SCHEDULER.max_num_batched_tokens
    """Token budget per step."""
    max_num_seqs: int = _SCHEDULER.max_num_seqs
    """Sequences per batch."""
    max_queue: int = _SCHEDULER.max_queue
    """Waiting requests before 429."""
    prefill_chunk: int | None = _SCHEDULER.prefill_chunk
    """Prompt tokens one request may prefill per step (default: the step's token budget)."""
    admission_wait: float = _SCHEDULER.admission_wait
    """Seconds an arriving request may be held to batch it with later ones (a static batching window)."""
    control: bool = False
    """Run the surge controller: latency or throughput mode from the traffic forecast, shedding the lowest tier
    first and routing lower tiers to cheaper `variants` under load, against the tiers' SLOs (`tenants_file`)."""
    control_capacity: float | None = None
    """Requests/s this server finishes at full load (`qpack bench serve` measures it): lets the controller act on
    the first surge's forecast, before it has measured one itself."""
    max_model_len: int | None = None
    """Context limit (default: the model's)."""
    request_timeout: float = 600.0
    """Seconds before a request is aborted."""
    api_keys: tuple[str, ...] = ()
    """Require 'Authorization: Bearer KEY' (any listed key is accepted)."""
    api_key_file: Path | None = None
    """File of accepted API keys, one per line (# comments)."""
    metrics_key: str | None = None
    """Require 'Authorization: Bearer KEY' on /metrics, whose labels name tenants and tiers (unset: open to
    whoever reaches the port; it binds 127.0.0.1 unless `host` says otherwise)."""
    tenants_file: Path | None = None
    """Tenants (TOML, JSON or YAML, by suffix): each one's API keys, service tier and limits (requests/tokens per
    minute, requests in flight, max_tokens); reloaded on SIGHUP. `api_keys` join it as the tenant `default`."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body; bigger ones get 413 before parsing."""
    dtype: str = "float32"
    """For plain models: float32, bfloat16 or float16."""
    prefix_caching: bool = _CACHE.prefix_caching
    """Share cached prompt prefixes."""
    compile: bool = False
    """torch.compile the decode steps the fused native step doesn't cover (over 16 sequences, layers it can't run,
    no native kernels); minutes of warm-up at start."""
    batch_invariant: bool = False
    """Every token through one native path (prefill too), so outputs don't depend on the batch or on reused KV
    (prefix cache, host memory, disk); prefill is slower. CPU with native kernels, int8/int4/bf16/FP32 linears."""
    prefill_dtype: str = DEFAULT_PREFILL_DTYPE
    """Precision of prefill-sized products of int8/int4 layers: float32 (every CPU, the default: exact integer
    sums of int16-rounded activations), bfloat16 (faster where the CPU has AMX-BF16/AVX512-BF16, at a KL cost;
    emulated elsewhere) or int8 (activations rounded to int8 per token; int4 prompts run ~1.3x faster, at the
    KL cost the manifest's quality.prompt_int8 records)."""
    speculative: str = _SPECULATION.mode
    """Speculative decoding at small batch: off, ngram (proposals looked up in the context), draft (proposed by
    `draft`, a cheaper copy of the model) or auto (per step, whichever is expected to yield more). Greedy output
    stays the same text; sampled output keeps the model's distribution."""
    draft: str | None = None
    """The draft model: an artifact of the same model (its int4 variant) or int4 / int4:G (built from the served
    model at load time, LM head included, group size G, default 64)."""
    speculative_k: int = _SPECULATION.k
    """Most tokens proposed per step (fewer where the measured acceptance says so)."""
    speculative_max_batch: int = _SPECULATION.max_batch
    """Decoding sequences above which a step doesn't speculate (verification is no longer nearly free)."""
    draft_kv_memory: str = str(_SPECULATION.draft_kv_memory)
    """The draft model's own KV pool."""
    kv_host_memory: str = "0"
    """Host memory for KV blocks of returning conversations (the host store), e.g. 2GB; 0: off."""
    kv_disk: str | None = None
    """Directory for KV blocks on disk (the disk store); survives restarts."""
    kv_disk_size: str = "10GB"
    """Bytes the KV disk store may hold (LRU beyond)."""
    kv_codec: str = _OFFLOAD.codec
    """Stored-block compression: zstd, zlib, lz4 or none."""
    session_ttl: float | None = _OFFLOAD.session_ttl
    """Seconds an idle session's KV is kept."""
    isolate_users: bool = _CACHE.isolate_users
    """Salt prefix caching by each request's `user`: no sharing across users."""
    redis: str | None = None
    """Redis URL of the fleet's queue (redis://127.0.0.1:6379/0, or redis://:PASSWORD@host:6379/0: logged with
    the password as ***; QPACK_REDIS_URL keeps it off the command line); needs a fleet role."""
    role: str = "single"
    """single (one process, no Redis), gateway (API, no model), worker (engine behind Redis), or all (gateway +
    workers here)."""
    workers: int = 2
    """Workers the all role starts beside its gateway."""
    worker_variants: str = "one"
    """With several TARGETS and the all role: one (the workers take the variants in turn) or all (each worker process
    holds every variant, their engines side by side on its cores; memory: every variant and a KV pool each). Measured
    on two cores under a surge: all lost the top tier's first tokens (84% in time against 99%)."""
    claim_idle: float = 10.0
    """Seconds before a dead worker's requests are taken over by another."""
    threads: int | None = None
    """Compute threads of this process (default: torch's)."""

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        for name in ("api_key_file", "tenants_file"):
            fields[name] = None if getattr(self, name) is None else str(getattr(self, name))
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> ServeOptions:
        """The options `to_json` wrote; unknown or missing fields are named all at once (values are checked by
        `validate`)."""
        try:
            fields: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise QpackError(f"serve options are not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise QpackError("serve options must be a JSON object")
        known = {field.name for field in dataclasses.fields(cls)}
        problems = [f"unknown field {name!r}" for name in sorted(set(fields) - known)]
        problems += [f"missing field {name!r}" for name in ("target",) if name not in fields]
        if problems:
            raise QpackError("invalid serve options: " + "; ".join(problems))
        for name in ("api_keys", "variants"):
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        for name in ("api_key_file", "tenants_file"):
            if fields.get(name) is not None:
                fields[name] = Path(fields[name])
        return cls(**fields)

    def validate(self) -> None:
        """Every problem at once (ConfigError), each named by its field, before anything is loaded."""
        problems = Problems()
        self._check_engine(problems)
        self._check_fleet(problems)
        problems.check(1 <= self.port <= 65535, "port", f"must be 1..65535 (got {self.port})")
        problems.check(
            self.request_timeout > 0, "request_timeout", f"must be > 0 (got {self.request_timeout})"
        )
        problems.check(
            self.max_request_bytes >= 1024,
            "max_request_bytes",
            f"must be at least 1024 (got {self.max_request_bytes})",
        )
        problems.check(
            all(key.strip() == key and key for key in self.api_keys),
            "api_keys",
            "must not be empty or padded",
        )
        problems.check(
            self.metrics_key is None or (self.metrics_key.strip() == self.metrics_key != ""),
            "metrics_key",
            "must not be empty or padded",
        )
        problems.check(
            self.metrics_key is not None or self.tenants_file is None or self.host in LOOPBACK,
            "metrics_key",
            f"is required with `tenants_file` on a non-loopback `host` ({self.host}): /metrics names every "
            "tenant; set --metrics-key KEY (or QPACK_METRICS_KEY), or bind --host 127.0.0.1",
        )
        problems.check_choice(self.dtype, "dtype", MODEL_DTYPES)
        problems.check(
            self.threads is None or self.threads >= 1, "threads", f"must be at least 1 (got {self.threads})"
        )
        problems.raise_if_any(self)

    def _check_engine(self, problems: Problems) -> None:
        for field in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, field)
            problems.check(value >= 1, field, f"must be at least 1 (got {value})")
        problems.check(self.max_queue >= 0, "max_queue", f"must be >= 0 (got {self.max_queue})")
        problems.check(
            self.prefill_chunk is None or self.prefill_chunk >= 1,
            "prefill_chunk",
            f"must be at least 1 (got {self.prefill_chunk})",
        )
        problems.check(
            self.admission_wait >= 0, "admission_wait", f"must be >= 0 seconds (got {self.admission_wait})"
        )
        problems.check(
            self.control_capacity is None or self.control_capacity > 0,
            "control_capacity",
            f"must be > 0 requests/s (got {self.control_capacity})",
        )
        problems.check_choice(self.kv_dtype, "kv_dtype", KV_DTYPE_NAMES)
        problems.check_choice(self.kv_codec, "kv_codec", CODECS)
        problems.check_choice(self.prefill_dtype, "prefill_dtype", PREFILL_DTYPE_NAMES)
        problems.check(
            self.session_ttl is None or self.session_ttl > 0,
            "session_ttl",
            f"must be > 0 seconds (got {self.session_ttl})",
        )
        problems.check_choice(self.speculative, "speculative", SPECULATIVE_MODES)
        problems.check(
            self.speculative not in ("draft", "auto") or bool(self.draft),
            "draft",
            f"is required by speculative {self.speculative} (an int4 artifact of the model, or int4)",
        )
        problems.check(
            1 <= self.speculative_k <= 15, "speculative_k", f"must be 1..15 (got {self.speculative_k})"
        )
        problems.check(
            self.speculative_max_batch >= 1,
            "speculative_max_batch",
            f"must be at least 1 (got {self.speculative_max_batch})",
        )
        for field in ("kv_memory", "kv_host_memory", "kv_disk_size", "draft_kv_memory"):
            value = getattr(self, field)
            problems.check(_is_size(value), field, f"{value!r} is not a size (e.g. 2GB)")

    def _check_fleet(self, problems: Problems) -> None:
        problems.check_choice(self.role, "role", ROLES)
        problems.check(
            self.role == "single" or bool(self.redis), "role", f"{self.role} needs `redis` (a URL)"
        )
        problems.check(
            self.role != "single" or not self.redis, "redis", "needs `role` gateway, worker or all"
        )
        problems.check(
            self.role == "gateway" or bool(self.target),
            "target",
            "is required: an artifact or model to serve",
        )
        problems.check(self.workers >= 1, "workers", f"must be at least 1 (got {self.workers})")
        problems.check(
            not self.variants or self.role != "gateway",
            "variants",
            "need `role` single, worker or all (a gateway serves no model)",
        )
        problems.check(
            self.worker_variants in ("all", "one"),
            "worker_variants",
            f"must be all or one (got {self.worker_variants!r})",
        )
        problems.check(self.claim_idle > 0, "claim_idle", f"must be > 0 seconds (got {self.claim_idle})")

    def keys(self) -> tuple[str, ...]:
        """`api_keys` and the lines of `api_key_file` (blank lines and # comments skipped)."""
        keys = list(self.api_keys)
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).expanduser().read_text().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise QpackError(
                    f"`api_key_file` {self.api_key_file} cannot be read ({exc}); fix the path"
                ) from None
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if len(keys) == len(self.api_keys):
                raise QpackError(f"`api_key_file` {self.api_key_file} holds no key; one key per line")
        return tuple(keys)
