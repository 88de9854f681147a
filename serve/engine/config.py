"""The engine's settings as nested configs, each declared once, torch-free.

`EngineConfig` holds one config per part it builds (`serve.engine.builder`): the scheduler's
(`serve.core.config.SchedulerConfig`), the paged KV cache's, the KV offload's and speculative decoding's, plus the
numeric path. `qpack serve`'s options (`serve.options.ServeOptions`) take their defaults from these classes and
are mapped onto them in one place (`serve.loading.engine_config`); nothing else repeats a setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.core.config import SchedulerConfig
from serve.kv_formats import CODECS, KV_DTYPE_NAMES

SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool."""

    # 8-token blocks: a sequence's unfilled last block (the KV waste) averages 3.5 slots, under 4% of the
    # allocation at ShareGPT lengths (16-token blocks measured 4.4-4.7% at peak).
    block_size: int = 8
    memory: str | float | int = "512MB"  # the pool's bytes, or a fraction of free memory ('0.25')
    dtype: str = "float32"  # the pool's element type (serve.kv_formats.KV_DTYPE_NAMES)
    prefix_caching: bool = True
    isolate_users: bool = False  # salt every request's prefix chain with its `user`

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {', '.join(KV_DTYPE_NAMES)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1 (got {self.block_size})")


@dataclass(frozen=True)
class OffloadConfig:
    """The KV offload below the pool (`serve.offload`): a host-memory store and a disk store, each bounded in bytes
    (0: off)."""

    host_memory: int = 0
    disk: str | None = None
    disk_size: int = 0
    codec: str = "zstd"
    session_ttl: float | None = (
        None  # seconds a stored conversation is kept after its last use (None: no limit)
    )

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"KV codec {self.codec!r} is not one of {', '.join(CODECS)}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_memory or self.disk)


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding (`serve.speculative`)."""

    mode: str = "off"  # off, ngram (prompt lookup), draft (a draft model), auto (both)
    k: int = 8  # most tokens proposed per step
    max_batch: int = 4  # decoding sequences above which a step doesn't speculate
    draft_kv_memory: str | float | int = "128MB"

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative mode {self.mode!r} is not one of {', '.join(SPECULATIVE_MODES)}")


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    max_model_len: int | None = None  # the context (None: the model's positions, or what the pool holds)
    device: str = "cpu"
    # torch.compile the decode step (minutes of warm-up, fewer per-op overheads) for the decode steps the fused
    # native step doesn't cover (more than kernels.max_rows() sequences, layers it can't run, no native kernels)
    compile: bool = False
    # every token through the fused native step and the native LM head, so that a token's KV and logits don't
    # depend on the batch or on whether its prefix was reused (serve/core/runner.py); prefill is slower
    batch_invariant: bool = False
    # the precision of prefill-sized GEMMs of int8/int4 linears (quantize.runtime.modules.PREFILL_DTYPES): float32
    # on every CPU unless asked; bfloat16 prefills faster where the CPU has AMX-BF16/AVX512-BF16, at a measured KL
    # cost
    prefill_dtype: str = "float32"
    model_hash: str = ""  # the artifact's content hash: stored blocks of another version are never read

    @property
    def numeric_identity(self) -> str:
        """What a KV block's bits depend on besides its tokens: the model's content and the numeric path (prefill
        dtype, batch-invariant mode). Cached and stored blocks are keyed by it, so a server never reuses blocks
        another path computed."""
        return f"{self.model_hash}|prefill={self.prefill_dtype}|invariant={int(self.batch_invariant)}"
