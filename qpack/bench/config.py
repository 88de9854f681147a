"""What `qpack bench decode` and `qpack bench serve` are asked for, as plain data (no torch: the command line
builds its options and help from these fields); `validate()` reports every problem at once, by field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantize.common.config import Problems
from quantize.runtime.precision import DEFAULT_PREFILL_DTYPE, PREFILL_DTYPE_NAMES

LOOPBACK_URLS = ("http://127.", "http://localhost", "http://[::1]")


@dataclass(frozen=True)
class DecodeConfig:
    """Prefill and decode speed of an artifact against FP32 `generate`, side by side."""

    artifact: Path
    """Artifact directory."""
    reference: str | None = None
    """Reference model (default: the artifact's source)."""
    batches: tuple[int, ...] = (1, 4, 16, 32)
    """Batch sizes."""
    prompt_tokens: int = 128
    """Prompt length."""
    new_tokens: int = 64
    """Tokens generated per sequence."""
    repeats: int = 3
    """Alternating runs per batch size (median reported)."""
    seed: int = 0
    """Seed of the random prompts."""
    compile: bool = False
    """Run the artifact with its torch.compile'd decode step (as `serve --compile`)."""
    prefill_dtype: str = DEFAULT_PREFILL_DTYPE
    """Precision of the artifact's prefill-sized products: float32, bfloat16 or int8 (as `serve --prefill-dtype`)."""
    speculative: str = "off"
    """Speculative decoding on the artifact (ngram, draft or auto, as `serve --speculative`): it then also runs
    without, alternating, and the prompts are ShareGPT text instead of random ids (proposals need real text)."""
    draft: str | None = None
    """The draft model for speculative draft/auto (as `serve --draft`; default int4)."""

    def validate(self) -> None:
        problems = Problems()
        problems.check(bool(self.batches) and min(self.batches) >= 1, "batches", "must be positive integers")
        problems.check_choice(self.speculative, "speculative", ("off", "ngram", "draft", "auto"))
        problems.check(self.prompt_tokens >= 1, "prompt_tokens", f"must be >= 1 (got {self.prompt_tokens})")
        problems.check(self.new_tokens >= 2, "new_tokens", f"must be >= 2 (got {self.new_tokens})")
        problems.check(self.repeats >= 1, "repeats", f"must be >= 1 (got {self.repeats})")
        problems.check_choice(self.prefill_dtype, "prefill_dtype", PREFILL_DTYPE_NAMES)
        problems.raise_if_any(self)


@dataclass(frozen=True)
class ServeBenchConfig:
    """A ShareGPT replay against a qpack server (started here, or at `url`) and the naive baseline."""

    artifact: Path | None
    """Artifact to serve (omit with url)."""
    url: str | None = None
    """Benchmark an already running server (loopback) instead."""
    baseline: str = "naive"
    """naive (HF generate, one at a time, FP32) or none."""
    baseline_model: str | None = None
    """Model for the naive baseline (default: the artifact's source)."""
    levels: tuple[int, ...] = (10, 30, 50)
    """Concurrency levels."""
    rates: tuple[float, ...] = ()
    """Poisson arrival rates (req/s), instead of or besides levels."""
    requests_per_level: int | None = None
    """Requests per level (default: the level)."""
    max_prompt_tokens: int = 512
    """Skip longer prompts."""
    max_output_tokens: int = 128
    """Cap on output tokens per request."""
    max_seconds: float = 900.0
    """Time limit per level and server."""
    abort_fraction: float = 0.0
    """Share of requests the client aborts mid-stream."""
    seed: int = 0
    """Request sampling seed."""
    kv_memory: str = "512MB"
    """KV pool of the qpack server."""
    max_num_seqs: int = 64
    """Sequences per batch of the qpack server."""
    prefill_dtype: str = DEFAULT_PREFILL_DTYPE
    """Prefill precision of the qpack server started here (a server at url reports its own)."""
    extra_server_args: tuple[str, ...] = ()
    """Extra `qpack serve` options, e.g. --kv-dtype=bfloat16."""

    def validate(self) -> None:
        problems = Problems()
        problems.check_choice(self.baseline, "baseline", ("naive", "none"))
        problems.check(
            self.artifact is not None or self.url is not None,
            "artifact",
            "is needed: an artifact directory to serve, or `url` of a running qpack server",
        )
        problems.check(
            self.url is None or self.url.startswith(LOOPBACK_URLS),
            "url",
            f"{self.url} is not a loopback address; the load generator only targets this machine",
        )
        problems.check(
            0.0 <= self.abort_fraction <= 1.0,
            "abort_fraction",
            f"must be in [0, 1] (got {self.abort_fraction})",
        )
        problems.check_choice(self.prefill_dtype, "prefill_dtype", PREFILL_DTYPE_NAMES)
        problems.raise_if_any(self)
